"""``with_structured_output`` for ChatKamera: a bound model (a JSON schema or a forced tool call) and a parser.

``json_schema`` (the default) decodes the answer under the schema itself; ``function_calling`` forces a call
of one tool whose arguments are the schema; ``json_mode`` only guarantees a JSON object (the schema, if any,
parses it but does not constrain it). Constrained decoding makes the first two parse on any model.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from kamera_sdk import InvalidInputError

Method = Literal["json_schema", "function_calling", "json_mode"]
METHODS: tuple[str, ...] = ("json_schema", "function_calling", "json_mode")


def answer_schema(schema: Any) -> dict[str, Any]:
    """The JSON schema an answer must match: a pydantic model's own, a TypedDict's or a dict's as LangChain
    converts it."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()
    if isinstance(schema, Mapping) and "function" not in schema and "parameters" not in schema:
        return dict(schema)  # already a JSON schema
    return convert_to_json_schema(schema)


def schema_name(schema: Any) -> str:
    """The name LangChain gives the schema as a tool (``convert_to_openai_tool``)."""
    return str(convert_to_openai_tool(schema)["function"]["name"])


def structured(
    llm: Any,
    schema: Any,
    method: str,
    include_raw: bool,
) -> Runnable[LanguageModelInput, Any]:
    """The runnable ``with_structured_output`` returns: the bound model, then the parser (and the raw reply
    with ``include_raw``)."""
    if method not in METHODS:
        raise InvalidInputError(f"method must be one of {METHODS}, got {method!r}")
    if schema is None and method != "json_mode":
        raise InvalidInputError(f"with_structured_output(method={method!r}) needs a schema")
    pydantic = is_basemodel_subclass(schema) if isinstance(schema, type) else False
    trace = {"kwargs": {"method": method}, "schema": schema}
    parser: Runnable[Any, Any]
    if method == "function_calling":
        name = schema_name(schema)
        bound = llm.bind_tools([schema], tool_choice=name, ls_structured_output_format=trace)
        if pydantic:
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
        else:
            parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    else:
        if method == "json_schema":
            js = answer_schema(schema)
            title = str(js.get("title") or "answer")
            fmt = {"type": "json_schema", "json_schema": {"name": title, "schema": js, "strict": True}}
        else:
            fmt = {"type": "json_object"}
        bound = llm.bind(response_format=fmt, **({"ls_structured_output_format": trace} if schema is not None else {}))
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")
