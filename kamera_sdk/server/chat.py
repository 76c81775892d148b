"""OpenAI-compatible chat completions over a window: each message is a chunk.

The engine's frame leaves a user turn open after its anchor (``generate`` puts documents and a question
there). Every message but the last becomes one text chunk that closes the turn in front and opens its
own in the chat template's markers (``<|im_end|>\\n<|im_start|>system\\nBe terse.`` for ChatML; see
``OpenTurnFormat``), so the model reads a conversation, and a message's chunk is the same text wherever
it lands. A message with images is its turn's opening, then one image chunk per image, then its text.
The last message is the prompt: its own turn after earlier messages, or the open turn's text alone.
Without a usable template, messages are ``"<role>: <content>"`` paragraphs inside the open turn. The
window is synced to the message list on every request: chunks of messages that left
the list are evicted, new ones added, and the order fixed by a reorder, so a growing or trimmed history
reuses every chunk it still holds instead of prefilling it again. Because the window equals the
messages after the sync, a window shared by one ``user`` value never leaks other requests' content
into an answer.
"""

from __future__ import annotations

import binascii
import json
import weakref
from dataclasses import dataclass, replace

from kamera_engine import Engine, Grammar, InvalidInputError, SamplingParams
from kamera_engine.decode import TextStream

from ..auto_tools import auto_grammar
from ..chat_format import OpenTurnFormat
from ..chunks import Chunk
from ..tools import ToolCall, ToolSpec, answer_prompt, closed_schema, json_grammar, parse_tool_call, tool_grammar
from ..window import ContextWindow
from .errors import LimitExceededError, PayloadTooLargeError
from .ops import Claim, Limits, check_tokens, claim_new, decode_image, first_piece, holds, sampling_params
from .schemas import ChatCompletionMessage, ChatCompletionRequest, ChatMessage, FunctionCall, ToolCallOut

#: Default answer length when a request names none (OpenAI's default is "until the context ends").
DEFAULT_MAX_TOKENS = 256

Item = str | bytes  # one chunk to be: text, or an image's bytes


_FORMATS: weakref.WeakKeyDictionary[Engine, OpenTurnFormat | None] = weakref.WeakKeyDictionary()


def turn_format(engine: Engine) -> OpenTurnFormat | None:
    """The engine's message format (read off its chat template once), or None for the plain one."""
    if engine not in _FORMATS:
        _FORMATS[engine] = OpenTurnFormat.for_engine(engine)
    return _FORMATS[engine]


def message_items(message: ChatMessage, limits: Limits, fmt: OpenTurnFormat | None) -> list[Item]:
    """The chunks of one (non-final) message: its turn's opening, its images, its text (``fmt``); or,
    without a template, its images, then ``"<role>: <text>"`` as a paragraph."""
    images: list[bytes] = []
    texts: list[str] = []
    if isinstance(message.content, str):
        texts.append(message.content)
    elif message.content is not None:
        for part in message.content:
            if part.type == "text":
                texts.append(part.text or "")
            elif part.image_url is not None:
                images.append(_data_url_bytes(part.image_url.url, limits))
    text = "\n".join(t for t in texts if t)
    if message.tool_calls:
        fns = [c.get("function") if isinstance(c, dict) else None for c in message.tool_calls]
        if not all(isinstance(f, dict) for f in fns):
            raise InvalidInputError("each tool_calls entry needs a 'function' object with 'name' and 'arguments'")
        calls = ", ".join(f"{f.get('name', '?')}({f.get('arguments', '')})" for f in fns)
        text = f"{text}\n[tool calls: {calls}]" if text else f"[tool calls: {calls}]"
    if fmt is not None:
        if message.name is not None and text.strip():
            text = f"{message.name}: {text}"
        if images:
            return [fmt.opening(message.role), *images, *([text] if text.strip() else [])]
        return [fmt.turn(message.role, text)] if text.strip() else []
    role = message.role if message.name is None else f"{message.role} ({message.name})"
    return [*images, f"{role}: {text}\n\n"] if text.strip() else list(images)


def prompt_text(message: ChatMessage) -> str:
    """The final message's text, the prompt of the answer."""
    if isinstance(message.content, str):
        text = message.content
    elif message.content is None:
        text = ""
    else:
        if any(p.type == "image_url" for p in message.content):
            raise InvalidInputError("put images in an earlier message: the last message is the prompt, text only")
        text = "\n".join(p.text or "" for p in message.content)
    if not text.strip():
        raise InvalidInputError("messages[-1] needs text content: it is the prompt")
    return text


def _data_url_bytes(url: str, limits: Limits) -> bytes:
    if not url.startswith("data:"):
        raise InvalidInputError("image_url must be a data: URL (this server does not fetch remote images)")
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise InvalidInputError("image data: URLs must be base64-encoded")
    try:
        return decode_image(data, limits)
    except PayloadTooLargeError:
        raise
    except (binascii.Error, ValueError) as exc:  # pragma: no cover - decode_image converts these
        raise InvalidInputError(f"bad image data: {exc}") from exc


def placed_tokens(items: list[str | Chunk], sizes: dict[str, int]) -> int:
    """The tokens ``items`` take in a window (``sizes``: each text's; the same picture twice is one chunk)."""
    images = {i.id: len(i) for i in items if isinstance(i, Chunk)}
    return sum(sizes[i] for i in items if isinstance(i, str)) + sum(images.values())


def sync_window(
    win: ContextWindow,
    items: list[str | Chunk],
    sizes: dict[str, int],
    limits: Limits,
    claim: Claim | None = None,
    *,
    let_go: bool = False,
) -> None:
    """Make ``win`` hold exactly ``items`` in this order (texts, and image chunks from ``image_chunk``),
    reusing every chunk it already has (``sizes``: the tokens of each text item, counted by the caller;
    ``claim``: ``claim_new``'s); everything is counted before anything changes.
    ``let_go`` (a chat window keyed by ``user``: a cache of what its client sends): when the claim is
    refused, and the window would fit without the chunks it holds that ``items`` no longer lists, those
    are forgotten and the claim made again; otherwise nothing changes."""
    placed = placed_tokens(items, sizes)
    check_tokens(win, placed - win.tokens, limits)
    unseen = 0  # tokens of the content the window has not seen (a repeated message is a copy: one more)
    copies: dict[str, int] = {}
    listed: set[str] = set()
    for item in items:
        if isinstance(item, str):
            k = copies[item] = copies.get(item, -1) + 1
            cid, n = win.text_id(item, copy=k), sizes[item]
        else:
            cid, n = item.id, len(item)
        if cid not in listed and not holds(win, cid):
            unseen += n
        listed.add(cid)
    synced = placed + unseen  # placed after the sync, and the new content
    try:
        claim_new(win, synced - win.tokens, claim)
    except LimitExceededError:
        if not let_go or claim is None or not _let_go(win, listed, synced, claim):
            raise
        claim_new(win, synced - win.tokens, claim)
    ids: list[str] = []
    seen: dict[str, int] = {}
    for item in items:
        if isinstance(item, str):
            k = seen[item] = seen.get(item, -1) + 1
            cid = str(win.add_text(item, copy=k))  # a repeated message is a message again
        else:
            cid = str(win.admit(item)[0])
        if cid not in ids:  # the same picture twice is one chunk
            ids.append(cid)
    for cid in [c for c in win.chunks if c not in ids]:
        win.evict(cid)
    present = [c for c in ids if c in win]  # a token budget may have slid some out
    if list(win.chunks) != present:
        win.reorder(present)


def _let_go(win: ContextWindow, listed: set[str], synced: int, claim: Claim) -> bool:
    """Forget the chunks of ``win`` (placed or evicted) that are not ``listed`` if, without them, it could
    hold what the sync adds (``synced``: its placed tokens and new content); whether it did. What it will hold
    is claimed before anything is forgotten, so no other session takes those tokens in between."""
    unlisted = [c for c in win.chunks + win.evicted if c not in listed]
    if not unlisted:
        return False
    gone = sum(len(win.chunk(c)) for c in unlisted)  # content only: a user's chat window has no forks sharing it
    try:
        claim(win.content_tokens - gone + synced)  # held after the sync (ops.held_tokens)
    except LimitExceededError:
        return False
    for cid in unlisted:
        if cid in win:
            win.evict(cid, forget=True)  # no patch formed for a recall that cannot come
        else:
            win.forget(cid)
    return True


@dataclass(slots=True)
class ChatStart:
    """The first piece of an answer, the iterator of the rest, and the prompt-side token counts."""

    pieces: TextStream  # its tokens and finish_reason give the usage once it is drained
    first: str | None
    prompt_tokens: int
    cached_tokens: int


def _asked_max_tokens(req: ChatCompletionRequest) -> int | None:
    """The answer length the request names (``max_completion_tokens`` first), None when it leaves it open."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def sampling(req: ChatCompletionRequest, limits: Limits) -> SamplingParams:
    max_tokens = _asked_max_tokens(req)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, limits.max_new_tokens)
    grammar = answer_grammar(req)
    return sampling_params(limits, max_tokens, req.temperature, req.top_p, req.stop, req.seed, grammar)


def request_tools(req: ChatCompletionRequest) -> list[ToolSpec]:
    """The tools the model may call in this answer (none when ``tool_choice`` is ``"none"``)."""
    if not req.tools or req.tool_choice == "none":
        return []
    specs = []
    for tool in req.tools:
        fn = tool.function
        try:
            parameters = closed_schema(fn.parameters or {"type": "object", "properties": {}})
            specs.append(ToolSpec(name=fn.name, description=fn.description or "", parameters=parameters))
        except ValueError as exc:
            raise InvalidInputError(f"tool {fn.name!r}: {exc}") from None
    return specs


def answer_grammar(req: ChatCompletionRequest) -> Grammar | None:
    """What the answer must match: a tool call (``tools``), JSON (``response_format``), or free text."""
    tools = request_tools(req)
    if tools and req.response_format is not None and req.response_format.type != "text":
        raise InvalidInputError("pass tools or a JSON response_format, not both")
    if tools:
        return tool_grammar(tools, tool_choice_name(req))
    if req.response_format is None or req.response_format.type == "text":
        return None
    if req.response_format.type == "json_object":
        return json_grammar(True)
    if req.response_format.json_schema is None:
        raise InvalidInputError("response_format of type json_schema needs its json_schema object")
    return json_grammar(req.response_format.json_schema.schema_)


def json_mode(req: ChatCompletionRequest) -> bool:
    """The answer is any JSON object (``response_format: {"type": "json_object"}``)."""
    return req.response_format is not None and req.response_format.type == "json_object"


def relevance_grammar(engine: Engine, fmt: OpenTurnFormat | None, req: ChatCompletionRequest) -> Grammar | None:
    """``tool_choice="auto"`` under the ``"relevance"`` policy: a call of a tool relevant to the last user
    message and not called since it, else text (``kamera_sdk.auto_tools``, as ChatKamera decides it). With
    no user message there is nothing to measure against and the model decides."""
    if fmt is None:
        raise InvalidInputError("auto_tool_policy 'relevance' needs a model with a chat template")
    last = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=None)
    if last is None:
        return answer_grammar(req)
    called = [
        str((call.get("function") or {}).get("name"))
        for m in req.messages[last + 1 :]
        if m.role == "assistant"
        for call in m.tool_calls or []
    ]
    return auto_grammar(engine, fmt.turn, prompt_text(req.messages[last]), request_tools(req), called)


def tool_choice_name(req: ChatCompletionRequest) -> str:
    """``"auto"``, ``"required"`` or the name of the one tool the request forces."""
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.function.name


def answer_message(req: ChatCompletionRequest, text: str, finish: str) -> tuple[ChatCompletionMessage, str]:
    """The assistant message of an answer and its finish reason: a tool call when the model made one."""
    call = parse_tool_call(text, request_tools(req)) if request_tools(req) else None
    if call is None:
        return ChatCompletionMessage(content=text), finish
    return ChatCompletionMessage(content=None, tool_calls=[tool_call_out(call)]), "tool_calls"


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=json.dumps(call.arguments)))


def _fit_answer(engine: Engine, req: ChatCompletionRequest, params: SamplingParams, positions: int) -> None:
    """Hold the answer to the model's context: an answer whose length the request left open is cut to the
    room left (below the server's default); an explicit ``max_tokens`` that does not fit, or messages that
    fill the context alone, are a ``ContextLengthError``."""
    limit = engine.context_length
    if limit is not None and _asked_max_tokens(req) is None:
        params.max_new_tokens = max(1, min(params.max_new_tokens, limit - positions))
    engine.check_length(positions, new_tokens=params.max_new_tokens, answer_field="max_tokens")


def start_chat(
    engine: Engine,
    win: ContextWindow | None,
    req: ChatCompletionRequest,
    params: SamplingParams,
    limits: Limits,
    claim: Claim | None = None,
    *,
    let_go: bool = False,
) -> ChatStart:
    """One worker job: sync the window to the messages, prefill the prompt, decode the first piece.

    ``win=None``: a window for this request only. ``claim``: the server's count of ``win`` (``check_tokens``).
    ``let_go``: ``sync_window``'s (a chat window keyed by ``user``).
    """
    fmt = turn_format(engine)
    items = [item for m in req.messages[:-1] for item in message_items(m, limits, fmt)]
    about = answer_prompt(request_tools(req), tool_choice_name(req), json_mode=json_mode(req))
    if about is not None:  # the tools and how to call them, or JSON mode's rule: a system turn before the messages
        items.insert(0, fmt.turn("system", about) if fmt is not None else f"system: {about}\n\n")
    last = req.messages[-1]
    prompt = prompt_text(last) if last.name is None else f"{last.name}: {prompt_text(last)}"
    if fmt is not None and items:  # a turn of its own after the others
        prompt = fmt.turn(last.role, prompt)
    prompt_ids = engine.prompt_ids(prompt)
    if req.auto_tool_policy == "relevance" and request_tools(req) and tool_choice_name(req) == "auto":
        params = replace(params, grammar=relevance_grammar(engine, fmt, req))
    anchor = len(engine.anchor_ids)
    sizes = {i: len(engine.tokenize(i)) for i in items if isinstance(i, str)}  # each text tokenized once
    if win is None and items:
        win = ContextWindow(engine)
    if win is None:
        _fit_answer(engine, req, params, anchor + len(prompt_ids))
    else:
        before = win.stats()
        chunks = [win.image_chunk(i) if isinstance(i, bytes) else i for i in items]  # the window is unchanged
        holds_all = win.config.budget_tokens is None  # no budget slides messages out in the sync
        if holds_all:  # the synced size is known now: refuse before any change
            _fit_answer(engine, req, params, anchor + placed_tokens(chunks, sizes) + len(prompt_ids))
        sync_window(win, chunks, sizes, limits, claim, let_go=let_go)
        if not holds_all:  # a budget may have slid some out
            _fit_answer(engine, req, params, anchor + win.tokens + len(prompt_ids))
    if win is not None and len(win):
        pieces = win.generate(
            prompt,
            params.max_new_tokens,
            stream=True,
            temperature=params.temperature,
            top_p=params.top_p,
            stop=list(params.stop),
            seed=params.seed,
            grammar=params.grammar,
        )
        computed = win.stats().computed_since(before) + len(prompt_ids)
        context = anchor + win.tokens
    else:  # no earlier messages: the prompt sits right behind the chat anchor
        pieces = engine.generate(engine.anchor_kv, prompt_ids, anchor, params)
        computed = len(prompt_ids)
        context = anchor
    total = context + len(prompt_ids)
    first = first_piece(pieces)
    return ChatStart(pieces, first, total, max(0, total - computed))
