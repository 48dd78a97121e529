"""Scripted experts for MiniWoB++ tasks: the next action from the goal text and the current page.

MiniWoB ships no demonstrations, but its goals are generated from a handful of templates each, so a few lines per
task read the target out of the goal and find it among the page's elements (the full, untruncated `WebState`).
An expert returns None when the page does not hold what it needs (then the collector stops or falls back); it never
guesses. `history` holds the episode's earlier actions that ran without error, for tasks whose page does not show
progress (click-button-sequence).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from dreamjax.envs.web_state import Element, WebState

Expert = Callable[[str, WebState, Sequence[str]], "str | None"]


def _quoted(goal: str) -> list[str]:
  return re.findall(r'"([^"]*)"', goal)


def _find(state: WebState, types: Sequence[str] | None = None, text: str | None = None,
          fold: bool = False) -> Element | None:
  for e in state.elements:
    if not e.actionable or (types is not None and e.type not in types):
      continue
    if text is None:
      return e
    a, b = e.description.strip(), text.strip()
    if (a.lower() == b.lower()) if fold else (a == b):
      return e
  return None


def _click(e: Element | None) -> str | None:
  return None if e is None else f"click({e.bid!r})"


def _holds(e: Element, text: str) -> bool:
  # Password inputs expose one bullet per character, never the text.
  value = e.value or ""
  return value == text or (len(value) == len(text) > 0 and set(value) == {"\u2022"})


def _fill_then_submit(state: WebState, entries: Sequence[tuple[Element | None, str]], submit: str) -> str | None:
  for e, text in entries:
    if e is None:
      return None
    if not _holds(e, text):
      return f"fill({e.bid!r}, {text!r})"
  return _click(_find(state, ("button",), submit, fold=True))


def _textboxes(state: WebState) -> list[Element]:
  return [e for e in state.elements if e.actionable and e.type in ("textbox", "textarea", "searchbox")]


def click_button(goal, state, history):  # Click on the "no" button.
  q = _quoted(goal)
  return _click(_find(state, ("button",), q[0])) if q else None


def click_link(goal, state, history):  # Click on the link "et".
  q = _quoted(goal)
  return _click(_find(state, ("link", "clickable"), q[0])) if q else None


def click_dialog(goal, state, history):  # Close the dialog box by clicking the "x". / ... labeled "OK".
  q = _quoted(goal)
  if not q:
    return None
  label = "Close" if q[0].lower() == "x" else q[0]
  return _click(_find(state, ("button",), label, fold=True))


def click_test(goal, state, history):  # Click the button.
  return _click(_find(state, ("button",)))


def click_test_2(goal, state, history):  # Click button ONE.
  m = re.search(r"Click button (\w+)", goal)
  return _click(_find(state, ("button",), m.group(1))) if m else None


def click_button_sequence(goal, state, history):  # Click button ONE, then click button TWO.
  one, two = _find(state, ("button",), "ONE"), _find(state, ("button",), "TWO")
  if one is None or two is None:
    return None
  activated = any(re.match(rf"(click|press)\({one.bid!r}[,)]", a) for a in history)
  return _click(two) if activated else _click(one)


def click_tab(goal, state, history):  # Click on Tab #2.
  m = re.search(r"(Tab #\d+)", goal)
  return _click(_find(state, ("link", "tab"), m.group(1))) if m else None


def click_collapsible(goal, state, history):  # Expand the section below and click submit.
  for e in state.elements:
    if e.actionable and e.type == "tab" and "collapsed" in e.states and e.description != "Submit":
      return _click(e)
  return _click(_find(state, ("button",), "Submit", fold=True))


def click_checkboxes(goal, state, history):  # Select Nb, Ne and click Submit. / Select nothing and click Submit.
  m = re.match(r"Select (.*) and click Submit\.?$", goal.strip())
  if not m:
    return None
  wanted = set() if m.group(1) == "nothing" else {w.strip() for w in m.group(1).split(",")}
  for e in state.elements:
    if e.actionable and e.type == "checkbox" and (e.description in wanted) != ("checked" in e.states):
      return _click(e)
  return _click(_find(state, ("button",), "Submit"))


def click_option(goal, state, history):  # Select QWS1FL and click Submit.
  m = re.match(r"Select (.*) and click Submit\.?$", goal.strip())
  radio = _find(state, ("radio",), m.group(1)) if m else None
  if radio is None:
    return None
  return _click(radio) if "checked" not in radio.states else _click(_find(state, ("button",), "Submit"))


def click_widget(goal, state, history):  # Click on a "textarea" widget.
  q = _quoted(goal)
  kind = {"text": "textbox"}.get(q[0], q[0]) if q else None
  return _click(_find(state, (kind,))) if kind else None


def choose_list(goal, state, history):  # Select Ertha from the list and click Submit.
  m = re.match(r"Select (.*) from the list and click Submit\.?$", goal.strip())
  select = next((e for e in state.elements if e.actionable and e.options), None)
  if m is None or select is None or m.group(1) not in select.options:
    return None
  if select.value != m.group(1):
    return f"select_option({select.bid!r}, {m.group(1)!r})"
  return _click(_find(state, ("button",), "Submit"))


def enter_text(goal, state, history):  # Enter "Myron" into the text field and press Submit.
  q, boxes = _quoted(goal), _textboxes(state)
  if not q or not boxes:
    return None
  return _fill_then_submit(state, [(boxes[0], q[0])], "Submit")


def enter_text_2(goal, state, history):  # Type "myron" in all upper case letters in the text input and press Submit.
  q, boxes = _quoted(goal), _textboxes(state)
  if not q or not boxes:
    return None
  text = q[0].upper() if "upper case" in goal else q[0].lower()
  return _fill_then_submit(state, [(boxes[0], text)], "Submit")


def enter_password(goal, state, history):  # Enter the password "Q1" into both text fields and press submit.
  q, boxes = _quoted(goal), _textboxes(state)
  if not q or len(boxes) < 2:
    return None
  return _fill_then_submit(state, [(boxes[0], q[0]), (boxes[1], q[0])], "Submit")


def login_user(goal, state, history):  # Enter the username "cierra" and the password "11L" ... and press login.
  q = _quoted(goal)
  user = _find(state, ("textbox",), "Username", fold=True)
  password = _find(state, ("textbox",), "Password", fold=True)
  if len(q) < 2:
    return None
  return _fill_then_submit(state, [(user, q[0]), (password, q[1])], "Login")


STATED_DATE = re.compile(r"(?<!\w)\d{2}/\d{2}/\d{4}(?!\w)")  # an MM/DD/YYYY date in a goal, not part of a longer run


def iso_date(date: str) -> str:
  """An MM/DD/YYYY date as YYYY-MM-DD: <input type=date> takes ISO dates through Playwright's fill, and the AX value
  reads back the same form."""
  month, day, year = date.split("/")
  return f"{year}-{month}-{day}"


def enter_date(goal, state, history):  # Enter 02/04/2012 as the date and hit submit.
  m = STATED_DATE.search(goal)
  date = _find(state, ("Date",))
  if m is None or date is None:
    return None
  return _fill_then_submit(state, [(date, iso_date(m.group(0)))], "Submit")


def focus_text(goal, state, history):  # Focus into the textbox.
  boxes = _textboxes(state)
  return _click(boxes[0]) if boxes else None


_ORDINALS = {"1st": 0, "2nd": 1, "3rd": 2, "4th": 3, "5th": 4}


def focus_text_2(goal, state, history):  # Focus into the 3rd input textbox.
  m = re.search(r"(\d(?:st|nd|rd|th))", goal)
  boxes = _textboxes(state)
  i = _ORDINALS.get(m.group(1)) if m else None
  return _click(boxes[i]) if i is not None and i < len(boxes) else None


EXPERTS: dict[str, Expert] = {
    "click-button": click_button,
    "click-button-sequence": click_button_sequence,
    "click-checkboxes": click_checkboxes,
    "click-collapsible": click_collapsible,
    "click-dialog": click_dialog,
    "click-dialog-2": click_dialog,
    "click-link": click_link,
    "click-option": click_option,
    "click-tab": click_tab,
    "click-test": click_test,
    "click-test-2": click_test_2,
    "click-widget": click_widget,
    "choose-list": choose_list,
    "enter-date": enter_date,
    "enter-password": enter_password,
    "enter-text": enter_text,
    "enter-text-2": enter_text_2,
    "focus-text": focus_text,
    "focus-text-2": focus_text_2,
    "login-user": login_user,
}


def expert_action(task_name: str, goal: str, state: WebState, history: Sequence[str] = (),
                  failed: str | None = None) -> str | None:
  """The scripted expert's next action for a MiniWoB task (e.g. "click-button"); None without an expert.

  `history`: the episode's actions that ran without error; `failed`: the last action if it raised an error.
  """
  expert = EXPERTS.get(task_name)
  action = None if expert is None else expert(goal, state, tuple(history))
  m = re.fullmatch(r"click\('([^']+)'\)", action or "")
  if m and action == failed:
    # MiniWoB places some elements over others; Playwright's click then times out waiting for the covered element.
    # Keyboard activation reaches it regardless (buttons, links and checkboxes act on Enter/Space).
    key = "Space" if (e := state.find(m.group(1))) is not None and e.type in ("checkbox", "radio") else "Enter"
    return f"press({m.group(1)!r}, {key!r})"
  return action
