"""WebShop: only what runs offline. The official environment (`web_agent_site` + product data) is not installable
here, so the adapter itself is untested; these tests cover its error message and its pure text helpers."""

import importlib.util

import pytest

from dreamjax.envs import make_env
from dreamjax.envs.webshop import (
    MISSING_WEBSHOP,
    WebShopActionError,
    check_webshop_action,
    outcome,
    page_name,
    parse_webshop_action,
    split_instruction,
    tasks,
    webshop_admissible,
    webshop_elements,
    webshop_state,
)

# HAND-WRITTEN EXAMPLES of WebShop's text observation format (observation_mode="text": the page's visible strings
# joined by " [SEP] "), written to follow its search-results and item-page templates. Not recorded from a real run:
# the environment cannot run offline here. Products and options are made up.
RESULTS_PAGE = (
    "Instruction: [SEP] i want a 3 ounce bottle of bright citrus deodorant for sensitive skin, and price lower than "
    "50.00 dollars [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B078GWRC1J [SEP] Bright "
    "Citrus Deodorant by Earth Mama | Natural and Safe for Sensitive Skin [SEP] $10.99 [SEP] B078GTKVXY [SEP] Ginger "
    "Fresh Deodorant by Earth Mama | Natural and Safe for Sensitive Skin [SEP] $10.99")
RESULTS_AVAILABLE = {"has_search_bar": False, "clickables": ["back to search", "next >", "b078gwrc1j", "b078gtkvxy"]}
ITEM_PAGE = (
    "Instruction: [SEP] i want a 3 ounce bottle of bright citrus deodorant for sensitive skin, and price lower than "
    "50.00 dollars [SEP] Back to Search [SEP] < Prev [SEP] scent [SEP] bright citrus [SEP] calming lavender [SEP] size "
    "[SEP] 3 ounce (pack of 1) [SEP] travel set (4-pack) [SEP] Bright Citrus Deodorant by Earth Mama | Natural and Safe "
    "for Sensitive Skin [SEP] Price: $10.99 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] "
    "Buy Now")
ITEM_AVAILABLE = {"has_search_bar": False, "clickables": [
    "back to search", "< prev", "description", "features", "reviews", "buy now", "bright citrus", "calming lavender",
    "3 ounce (pack of 1)", "travel set (4-pack)"]}
SEARCH_PAGE = "WebShop [SEP] Instruction: [SEP] i want a red umbrella [SEP] Search"
SEARCH_AVAILABLE = {"has_search_bar": True, "clickables": ["search"]}


@pytest.mark.skipif(importlib.util.find_spec("web_agent_site") is not None, reason="WebShop is installed here")
def test_missing_webshop_says_it_cannot_run_here():
  with pytest.raises(ImportError) as err:
    make_env("webshop")
  message = str(err.value)
  assert message == MISSING_WEBSHOP
  assert "web_agent_site" in message and "stub" in message and "offline" in message and "untested" in message


def test_parse_and_check_actions():
  assert parse_webshop_action("search[Red Umbrella]") == ("search", "Red Umbrella")
  assert parse_webshop_action(" click[Buy Now] ") == ("click", "buy now")
  for bad in ["buy now", "click[]", "jump[3]", "search[ ]"]:
    with pytest.raises(WebShopActionError):
      parse_webshop_action(bad)
  assert check_webshop_action("click[B078GWRC1J]", RESULTS_AVAILABLE) == "click[b078gwrc1j]"
  with pytest.raises(WebShopActionError, match="search page"):
    check_webshop_action("search[deodorant]", RESULTS_AVAILABLE)
  with pytest.raises(WebShopActionError, match="no such"):
    check_webshop_action("click[buy now]", RESULTS_AVAILABLE)
  assert check_webshop_action("search[red umbrella]", SEARCH_AVAILABLE) == "search[red umbrella]"
  with pytest.raises(WebShopActionError):
    check_webshop_action("click[search]", SEARCH_AVAILABLE)  # WebShop ignores it; searching is search[...]


def test_admissible_templates():
  assert webshop_admissible(SEARCH_AVAILABLE) == ("search[<text>]",)
  assert webshop_admissible(RESULTS_AVAILABLE) == (
      "click[back to search]", "click[next >]", "click[b078gwrc1j]", "click[b078gtkvxy]")


def test_results_page_maps_to_elements():
  instruction, segments = split_instruction(RESULTS_PAGE)
  assert instruction.startswith("i want a 3 ounce bottle")
  elements = webshop_elements(segments, RESULTS_AVAILABLE["clickables"])
  lines = [e.render(max_chars=120) for e in elements]
  assert lines == [
      "[back to search] button: Back to Search",
      "[-] text: Page 1 (Total results: 50)",
      "[next >] button: Next >",
      "[b078gwrc1j] product: Bright Citrus Deodorant by Earth Mama | Natural and Safe for Sensitive Skin | $10.99",
      "[b078gtkvxy] product: Ginger Fresh Deodorant by Earth Mama | Natural and Safe for Sensitive Skin | $10.99",
  ]
  state = webshop_state(instruction, page_name("http://127.0.0.1:3000/search_results/abc/deodorant/1"), elements)
  assert state.splitlines()[:2] == [f"Goal: {instruction}", "Page: search results"]


def test_item_page_maps_options_to_their_groups():
  instruction, segments = split_instruction(ITEM_PAGE)
  elements = webshop_elements(segments, ITEM_AVAILABLE["clickables"])
  by_bid = {e.bid: e for e in elements if e.actionable}
  assert by_bid["bright citrus"].type == "option" and by_bid["bright citrus"].description == "scent: bright citrus"
  assert by_bid["3 ounce (pack of 1)"].description == "size: 3 ounce (pack of 1)"
  assert by_bid["buy now"].type == "button" and by_bid["< prev"].type == "button"
  texts = [e.description for e in elements if not e.actionable]
  assert "Price: $10.99" in texts and "scent" in texts
  assert {f"click[{b}]" for b in by_bid} == set(webshop_admissible(ITEM_AVAILABLE))
  assert page_name("http://127.0.0.1:3000/item_page/abc/B078GWRC1J/deodorant/1/{}") == "item page"


def test_search_page_and_outcome_and_tasks():
  instruction, segments = split_instruction(SEARCH_PAGE)
  assert instruction == "i want a red umbrella" and segments == ["Search"]
  assert webshop_elements(segments, SEARCH_AVAILABLE["clickables"])[0].type == "text"
  assert page_name(None) == "search" and page_name("http://127.0.0.1:3000/done/abc/B0/{}") == "done"
  assert outcome(1.0, True) == (1.0, True)
  assert outcome(0.75, True) == (0.0, False)  # a partial match is a failure: success means score == 1
  assert outcome(1.0, False) == (0.0, False)
  assert [t.param["session"] for t in tasks("test", 2)] == [0, 1]
  assert [t.param["session"] for t in tasks("eval", 2, start=3)] == [503, 504]
  assert tasks("train", 1)[0].task_id == "webshop/train/0" and tasks("train", 1)[0].param["session"] == 1500
  with pytest.raises(ValueError):
    tasks("dev", 1)
