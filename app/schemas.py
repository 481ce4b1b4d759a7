"""Request and response bodies of the OpenAI-compatible API, as Pydantic models.

FastAPI validates requests against these models and documents them in /openapi.json.
Validation is strict (no "5" for 5, no "yes" for true) and unknown fields are tolerated, as
OpenAI clients send many. A failed validation becomes OpenAI's 400 error whose `param` names
the field (dotted for nested objects: "srsd.mode") and whose message says what is accepted
(`validation_error`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import MODES
from ..llama.tools import (
    TOOL_CHOICE_ACCEPTED,
    TOOLS_ACCEPTED,
    forced_names,
    validate_tool_choice,
    validate_tools,
)
from .errors import APIError
from .service import GenRequest

Mode = Literal[MODES]  # type: ignore[valid-type]  # the modes of config.MODES
Role = Literal["system", "user", "assistant", "developer", "tool"]
FinishReason = Literal["stop", "length", "tool_calls"]
MAX_LOGPROBS = 20  # the engine's most alternatives per token

# what each field accepts, for the error messages and the field descriptions
ACCEPTED = {
    "model": "a string: the id from GET /v1/models",
    "prompt": "a string (or one token-id array, or an array of one string); batches of "
              "prompts are not supported",
    "messages": "a non-empty array of {role: system | user | assistant | developer | tool, "
                "content: a string or an array of text parts {type: text, text}} (an "
                "assistant message may carry tool_calls and a null content; a tool message "
                "its tool_call_id)",
    "max_tokens": "an integer >= 1",
    "max_completion_tokens": "an integer >= 1",
    "temperature": "a number in [0, 2]",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer >= 0 (0: off)",
    "min_p": "a number in [0, 1]",
    "seed": "an integer >= 0",
    "stop": "a string or an array of up to 16 strings",
    "n": "only 1 (one choice per request)",
    "stream": "true or false",
    "stream_options": "an object such as {\"include_usage\": true}",
    "stream_options.include_usage": "true or false",
    "srsd": "an object such as {\"mode\": \"srsd\"}",
    "srsd.mode": ", ".join(MODES),
    "tools": "none here: tools need a chat template, send them to /v1/chat/completions "
             "(omit it, or send null or [])",
    "functions": "none yet: function calling is not supported (omit it, or send null or [])",
    "tool_choice": "\"none\" or \"auto\" here (tools are for /v1/chat/completions)",
    "function_call": "\"none\" or \"auto\" (function calling is not supported yet)",
    "response_format": "{\"type\": \"text\"}, {\"type\": \"json_object\"} (optionally with "
                       "\"schema\"), or {\"type\": \"json_schema\", \"json_schema\": {\"name\": "
                       "..., \"schema\": {a JSON schema}}}",
    "grammar": "a GBNF grammar (llama.cpp's format) as a string, with a rule named root",
    "json_schema": "a JSON schema object (llama-server's field; same as response_format "
                   "json_schema)",
    "logprobs": f"an integer 0..{MAX_LOGPROBS} (OpenAI allows 0..5; up to {MAX_LOGPROBS} "
                "here): the most likely alternatives to report with each token, or null (off)",
    "top_logprobs": f"an integer 0..{MAX_LOGPROBS}, with \"logprobs\": true: the most likely "
                    "alternatives to report with each token",
}
# where chat completions accept something else under the same name
ACCEPTED_CHAT = {
    "logprobs": "true or false: report each token's log-probability (and, with "
                "top_logprobs, the most likely alternatives)",
    "tools": TOOLS_ACCEPTED + ", where the model's chat template renders tools",
    "tool_choice": TOOL_CHOICE_ACCEPTED + " (a forced call excludes response_format, "
                   "grammar and json_schema)",
}
# fields OpenAI defines that this server cannot honour yet: refused, not silently ignored
# (field -> whether a value is acceptable)
UNSUPPORTED = {
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
}
CONSTRAINT_FIELDS = ("response_format", "grammar", "json_schema")


def _doc(name: str, text: str, chat: bool = False) -> str:
    return f"{text} Accepted: {(ACCEPTED_CHAT if chat else ACCEPTED)[name]}."


def accepted(model: type[BaseModel], param: str) -> str:
    """What `param` of the body `model` accepts, for error messages."""
    extra: dict[str, str] = getattr(model, "ACCEPTED_HERE", {})
    return extra.get(param) or ACCEPTED.get(param, "see /docs")


class _Open(BaseModel):
    """Strict types; unknown fields are kept (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class SrsdOptions(_Open):
    """srsd-local's extension (send it with the openai client's `extra_body`)."""

    mode: Mode | None = Field(None, description=_doc(
        "srsd.mode", "Decoding mode of this request (default: the server's --mode)."))


class StreamOptions(_Open):
    include_usage: bool | None = Field(False, description=_doc(
        "stream_options.include_usage", "Send a last chunk with `usage` and `timings`."))


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
OneString = Annotated[list[str], Field(min_length=1, max_length=1)]
StopList = Annotated[list[str], Field(max_length=16)]


class _Generation(_Open):
    """Fields shared by completions and chat completions (None: the default)."""

    model: str | None = Field(None, description=_doc("model", "The model to use."))
    max_tokens: int | None = Field(None, ge=1, description=_doc(
        "max_tokens", "Tokens to generate at most (default: what the context leaves)."))
    max_completion_tokens: int | None = Field(None, ge=1, description=_doc(
        "max_completion_tokens", "Same as max_tokens, which it overrides."))
    temperature: float | None = Field(1.0, ge=0, le=2, description=_doc(
        "temperature", "Sampling temperature; 0 is greedy."))
    top_p: float | None = Field(1.0, gt=0, le=1, description=_doc("top_p", "Nucleus sampling."))
    top_k: int | None = Field(0, ge=0, description=_doc("top_k", "Top-k sampling (extension)."))
    min_p: float | None = Field(0.0, ge=0, le=1, description=_doc(
        "min_p", "Min-p sampling (extension)."))
    seed: int | None = Field(None, ge=0, description=_doc(
        "seed", "Seed of the sampler: the same seed gives the same output."))
    stop: str | StopList | None = Field(None, description=_doc(
        "stop", "Generation stops before any of these strings."))
    n: Literal[1] | None = Field(1, description=_doc("n", "Choices to generate."))
    stream: bool | None = Field(False, description=_doc(
        "stream", "Stream server-sent events (text/event-stream), ending with `data: [DONE]`."))
    stream_options: StreamOptions | None = Field(None, description=_doc(
        "stream_options", "Streaming options."))
    srsd: SrsdOptions | None = Field(None, description=_doc(
        "srsd", "srsd-local's options."))
    response_format: dict[str, Any] | None = Field(None, description=_doc(
        "response_format", "Constrain the output to JSON, or to a JSON schema."))
    grammar: str | None = Field(None, description=_doc(
        "grammar", "Constrain the output to a grammar (extension, as llama-server)."))
    json_schema: dict[str, Any] | None = Field(None, description=_doc(
        "json_schema", "Constrain the output to a JSON schema (extension, as llama-server)."))

    def _constraint(self) -> tuple[str | None, Any, str | None]:
        """(grammar, json_schema, the field they came from) of this request."""
        given = [n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None
                 and getattr(self, n) != {"type": "text"}]
        if len(given) > 1:
            raise APIError(400, f"give one of {', '.join(CONSTRAINT_FIELDS)}, not "
                           f"{' and '.join(given)}", param=given[1], code="invalid_value")
        if not given:
            return None, None, None
        name = given[0]
        if name == "grammar":
            return self.grammar, None, name
        if name == "json_schema":
            return None, self.json_schema, name
        rf = self.response_format or {}
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema", {"type": "object"})
            return None, schema, "response_format"
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise APIError(400, "response_format.json_schema.schema is required: a JSON "
                               "schema object; accepted: " + ACCEPTED["response_format"],
                               param="response_format.json_schema", code="invalid_value")
            return None, js["schema"], "response_format"
        raise APIError(400, f"response_format type {kind!r} is not supported; accepted: "
                       + ACCEPTED["response_format"], param="response_format",
                       code="invalid_value")

    def _refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, acceptable in UNSUPPORTED.items():
            value = extra.get(name)
            if not acceptable(value):
                shown = json.dumps(value, default=str)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise APIError(400, f"'{name}' {shown} is not supported yet by this server; "
                               f"accepted: {ACCEPTED[name]}", param=name,
                               code="unsupported_parameter")

    def _gen_request(self, kind: str, prompt: str | list[int] | None,
                     messages: list[dict] | None, logprobs: int | None) -> GenRequest:
        self._refuse_unsupported()
        grammar, json_schema, constraint_param = self._constraint()
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        so, ext = self.stream_options, self.srsd
        return GenRequest(
            kind=kind, prompt=prompt, messages=messages, max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=self.top_k or 0,
            min_p=0.0 if self.min_p is None else float(self.min_p),
            seed=self.seed,
            stop=[] if self.stop is None else [self.stop] if isinstance(self.stop, str)
            else list(self.stop),
            stream=bool(self.stream),
            include_usage=bool(so is not None and so.include_usage),
            mode=ext.mode if ext is not None else None, model=self.model, logprobs=logprobs,
            grammar=grammar, json_schema=json_schema, constraint_param=constraint_param)


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | OneString | TokenIds = Field(description=_doc(
        "prompt", "The text to continue, or its token ids (BOS included)."))
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=_doc(
        "logprobs", "Report each token's log-probability and this many most likely "
        "alternatives (`choices[].logprobs`: tokens, token_logprobs, top_logprobs, "
        "text_offset); the sampled token is always among top_logprobs."))

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        return v[0] if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str) else v

    def to_gen_request(self) -> GenRequest:
        return self._gen_request("completion", self.prompt, None, self.logprobs)


class TextPart(_Open):
    type: Literal["text"]
    text: str


class FunctionCall(_Open):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class MessageToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Role = Field(description="'developer' is read as 'system'.")
    content: str | list[TextPart] | None = Field(
        None, description="required but for an assistant message with tool_calls")
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="the calls an assistant message made")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    name: str | None = None


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions (the model's chat template renders the messages)."""

    ACCEPTED_HERE: ClassVar[dict[str, str]] = ACCEPTED_CHAT

    messages: list[ChatMessage] = Field(min_length=1, description=_doc(
        "messages", "The conversation so far."))
    logprobs: bool | None = Field(False, description=_doc(
        "logprobs", "Report each content token's log-probability (`choices[].logprobs."
        "content`).", chat=True))
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=_doc(
        "top_logprobs", "The most likely alternatives to report with each token."))
    tools: list[dict[str, Any]] | None = Field(None, description=_doc(
        "tools", "Functions the model may call: the chat template renders them and the "
        "answer's `tool_calls` holds the calls it makes (`finish_reason` \"tool_calls\").",
        chat=True))
    tool_choice: str | dict[str, Any] | None = Field(None, description=_doc(
        "tool_choice", "Whether the model may (\"auto\", the default with tools), must "
        "(\"required\", or a named function) or must not (\"none\": the tools are not "
        "offered) call a function; a forced call is constrained by a grammar.", chat=True))

    def _tools(self) -> tuple[list[dict[str, Any]], Any]:
        """The validated tools and tool_choice."""
        try:
            tools = validate_tools(self.tools)
        except ValueError as exc:
            raise APIError(400, f"{exc}", param="tools", code="invalid_value") from exc
        try:
            choice = validate_tool_choice(self.tool_choice, tools)
        except ValueError as exc:
            raise APIError(400, f"{exc}", param="tool_choice", code="invalid_value") from exc
        return tools, choice

    def to_gen_request(self) -> GenRequest:
        msgs = [m.model_dump(exclude_unset=True) for m in self.messages]
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, f"'top_logprobs' {self.top_logprobs} needs \"logprobs\": true; "
                           f"accepted: {ACCEPTED['top_logprobs']}", param="top_logprobs",
                           code="invalid_value")
        n = (self.top_logprobs or 0) if self.logprobs else None
        tools, choice = self._tools()
        req = self._gen_request("chat", None, msgs, n)
        if forced_names(tools, choice) and req.constraint_param is not None:
            raise APIError(400, f"a forced tool_choice constrains the output itself; it cannot "
                           f"be combined with {req.constraint_param}", param="tool_choice",
                           code="invalid_value")
        req.tools, req.tool_choice = tools or None, choice
        return req


# -- responses ------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, stats: Any) -> Usage:
        return cls(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.tokens,
                   total_tokens=stats.prompt_tokens + stats.tokens)


class Timings(BaseModel):
    """llama.cpp server's `timings`, with the speculative decoding counts."""

    prompt_n: int = Field(description="prompt tokens processed (not reused from the context)")
    prompt_ms: float
    cache_n: int = Field(description="prompt tokens reused from the context")
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    draft_n: int = Field(description="drafted tokens verified")
    draft_n_accepted: int = Field(description="drafted tokens accepted")
    mean_accepted_length: float = Field(description="tokens per forward pass")
    mode: str

    @classmethod
    def of(cls, stats: Any) -> Timings:
        return cls(prompt_n=stats.prompt_tokens - stats.reused_prompt_tokens,
                   prompt_ms=stats.prompt_seconds * 1000.0,
                   cache_n=stats.reused_prompt_tokens, predicted_n=stats.tokens,
                   predicted_ms=stats.seconds * 1000.0,
                   predicted_per_second=stats.tokens_per_second,
                   draft_n=stats.draft_tokens, draft_n_accepted=stats.accepted_tokens,
                   mean_accepted_length=stats.mean_accepted_length, mode=stats.mode)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: per token its text, log-probability, the most likely
    alternatives ({text: logprob}, the sampled token included) and its character offset
    in the prompt followed by the completion."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """The answer of /v1/completions; with stream, each event's data is one of these
    (object "text_completion"), the last one with `usage` when asked."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's text as UTF-8 bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the most likely tokens at this "
                                           "position, most likely first")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(ToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the text; with tool_calls, the text before "
                                "them, or null")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class ModelCard(BaseModel):
    id: str = Field(description="what a request's `model` names; a model not loaded yet is "
                    "loaded by the first request that names it")
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "srsd-local"
    loaded: bool = Field(True, description="resident now (extension)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class DevicePlacement(BaseModel):
    device: str = Field(description="llama.cpp's device name: CPU, CUDA0, RPC0, ...")
    description: str
    where: str = Field(description="'local', or the HOST:PORT of the RPC worker")
    layers: str = Field(description="the layers it holds, e.g. '0-8' or '9-17, output'")


class Health(BaseModel):
    status: str = Field(description="'ok'; with 503: 'loading model' or 'error'")
    model: str | None = None
    error: str | None = None
    devices: list[DevicePlacement] | None = Field(
        default=None, description="which device holds which layers of the current model")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- validation errors -> OpenAI's 400 -------------------------------------------------------------
_FIELD_NAMES = {name for cls in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                                 SrsdOptions, StreamOptions, MessageToolCall, FunctionCall)
                for name in cls.model_fields}


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field that holds one object (Optional included), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if arg is not type(None) and (found := _nested_model(arg)) is not None:
            return found
    return None


def _param(model: type[BaseModel], loc: tuple) -> str | None:
    """The dotted field path of an error's location, down to the first array or union."""
    names: list[str] = []
    cls: type[BaseModel] | None = model
    for part in loc:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            break
        names.append(part)
        cls = _nested_model(cls.model_fields[part].annotation)
    return ".".join(names) or None


def _where(loc: tuple) -> str:
    """messages[0].role: the location without union tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
    return out


def validation_error(errors: list[dict[str, Any]], model: type[BaseModel]) -> APIError:
    """OpenAI's 400 for Pydantic's errors of one body (locations start inside the body)."""
    if not errors:
        return APIError(400, "the request body is invalid")
    # of a union's alternatives, the error that got furthest is the most telling
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        return APIError(400, f"the request body is not valid JSON: {detail}")
    param = _param(model, loc)
    if param is None:
        return APIError(400, "the request body must be a JSON object with the fields of "
                        f"{model.__name__} (see /docs)")
    accepted_ = accepted(model, param)
    where = _where(loc) or param
    if err.get("type") == "missing":
        return APIError(400, f"'{where}' is required; accepted: {accepted_}", param=param,
                        code="invalid_value")
    shown = json.dumps(err.get("input"), default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    why = f" ({err.get('msg')})" if where != param else ""
    return APIError(400, f"invalid '{where}': {shown}{why}; accepted: {accepted_}", param=param,
                    code="invalid_value")


def parse_request(body: Any, kind: str) -> GenRequest:
    """Validate a decoded JSON body ("completion" or "chat") into a GenRequest."""
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(body).to_gen_request()
    except ValidationError as exc:
        raise validation_error(exc.errors(), model) from exc
