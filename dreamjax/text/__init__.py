"""Text: tokenizer loading and training, chat formats read off chat templates, token-in/token-out segments."""

from dreamjax.text.segments import ROLE_OF_KIND, Kind, SegmentBuilder, policy_mask
from dreamjax.text.tokenizer import (
    ChatFormat,
    RoleFormat,
    Tokenizer,
    derive_chat_format,
    load_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "ROLE_OF_KIND",
    "ChatFormat",
    "Kind",
    "RoleFormat",
    "SegmentBuilder",
    "Tokenizer",
    "derive_chat_format",
    "load_tokenizer",
    "policy_mask",
    "train_bpe_tokenizer",
]
