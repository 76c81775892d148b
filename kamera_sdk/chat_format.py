"""How one chat message becomes one chunk of text, derived from the tokenizer's chat template.

A chat transcript is a run of self-contained turns (``<|im_start|>user\\n...<|im_end|>\\n`` for ChatML),
so each turn can be its own position-free chunk: reusable wherever it lands in the window. This module
reads the per-role markers off the template by rendering sentinel messages and taking differences, so
any template that renders a message independently of its neighbours works; others fall back to a plain
``Role: text`` format.

Two framings use it. ``ChatFormat``: the window's anchor stops before any turn (ChatKamera's chat
engine), and a message is ``<header>text<footer>``. ``OpenTurnFormat``: the anchor is the engine's
default frame, which leaves a user turn open (documents and a question sit in it, as ``generate``
does), and a message is ``<footer><header>text``: it closes the turn in front and opens its own (the
engine server's chat endpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# letters only: templates that trim message content (Llama 3's ``| trim``) keep them whole
_A = "KAMERASENTINELAXQZ"
_B = "KAMERASENTINELBXQZ"
_X = "KAMERASENTINELXXQZ"
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Per-role turn markers plus the two fixed pieces around the window.

    ``anchor``: text in front of every window (the template's BOS and default system turn), the
    window's fixed anchor. ``generation``: the assistant header that the reply follows (the prompt).
    ``markers``: role -> (header, footer) of one turn.
    """

    anchor: str
    generation: str
    markers: dict[str, tuple[str, str]] = field(default_factory=dict)
    source: str = "template"  # "template" or "plain" (no usable chat template)

    def render(self, role: str, content: str) -> str:
        """One turn as chunk text. A role the template does not render is sent as a tagged user turn."""
        if role in self.markers:
            header, footer = self.markers[role]
            return f"{header}{content}{footer}"
        header, footer = self.markers["user"]
        return f"{header}[{role}] {content}{footer}"

    @classmethod
    def plain(cls, bos: str = "") -> ChatFormat:
        """``Role: text`` turns for tokenizers without a chat template."""
        markers = {role: (f"{role.capitalize()}: ", "\n\n") for role in ROLES}
        return cls(anchor=bos, generation="Assistant:", markers=markers, source="plain")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        """Derive the format from ``tokenizer.chat_template`` (plain format when it has none or it cannot
        render a turn on its own)."""
        bos = getattr(tokenizer, "bos_token", None) or ""
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain(bos)

        def render(messages: list[dict[str, str]], gen: bool = False) -> str:
            return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen))

        try:
            markers = _markers(render)
            first_user = render([{"role": "user", "content": _B}]).partition(_B)[0]
            user_header = markers["user"][0]
            base = render([{"role": "user", "content": _A}])
            generation = render([{"role": "user", "content": _A}], gen=True)
        except Exception:  # a template that raises on sentinel messages: any error means "not usable"
            return cls.plain(bos)
        if not first_user.endswith(user_header) or not generation.startswith(base):
            return cls.plain(bos)
        return cls(
            anchor=first_user[: len(first_user) - len(user_header)], generation=generation[len(base) :], markers=markers
        )


def _markers(render: Callable[..., str]) -> dict[str, tuple[str, str]]:
    """role -> (header, footer): the difference a turn of that role makes after a user turn, or, for a
    template that insists on alternating roles, after a user and an assistant turn."""
    user, assistant = {"role": "user", "content": _A}, {"role": "assistant", "content": _X}
    out: dict[str, tuple[str, str]] = {}
    for role in ROLES:
        for before in ([user], [user, assistant]):
            try:
                base = render(before)
                full = render([*before, {"role": role, "content": _B}])
            except Exception:  # the template refuses this role here (e.g. strict alternation)
                continue
            header, sep, footer = full[len(base) :].partition(_B) if full.startswith(base) else ("", "", "")
            if sep:
                out[role] = (header, footer)
                break
    if "user" not in out:
        raise ValueError("the chat template does not render a user turn on its own")
    return out


#: OpenAI roles the templates know under another name.
_ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class OpenTurnFormat:
    """Turns for a window behind an anchor that leaves a user turn open.

    A message becomes ``<footer><header>text``: the footer (the user turn's, which the engine's prompt
    suffix also closes with) closes the turn in front, the header opens the message's own. The text is the same
    wherever the message lands, so it is reused as a position-free chunk. A role the template does not
    render is sent as a tagged user turn.
    """

    footer: str
    headers: dict[str, str]

    def opening(self, role: str) -> str:
        """The footer of the turn in front and the header of this role's turn (the text, or an image, follows)."""
        header = self.headers.get(_ROLE_ALIASES.get(role, role))
        return self.footer + (header if header is not None else f"{self.headers['user']}[{role}] ")

    def turn(self, role: str, text: str) -> str:
        """A whole message as chunk text."""
        return self.opening(role) + text

    @classmethod
    def for_engine(cls, engine: Any) -> OpenTurnFormat | None:
        """The format for ``engine``'s default frame, or None when its chat template cannot give one (no
        template, or an anchor and prompt suffix that are not this template's open user turn)."""
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            return None
        fmt = ChatFormat.from_tokenizer(tokenizer)
        if fmt.source != "template":
            return None
        user_header, footer = fmt.markers["user"]
        if engine.tokenize(fmt.anchor + user_header) != list(engine.anchor_ids):
            return None  # the engine's frame is not this template's open user turn
        if engine.tokenize(footer + fmt.generation) != list(engine.prompt_suffix_ids):
            return None  # nor does its prompt close that turn and open the assistant's
        # roles whose turn ends as the user's does (Qwen's tool turn does not): the others are sent
        # as tagged user turns
        headers = {role: header for role, (header, end) in fmt.markers.items() if end == footer}
        return cls(footer=footer, headers=headers)
