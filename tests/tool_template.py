"""A small tool-aware chat template in the Gemma turn format, Hermes-like: the tools as JSON
in a system turn, calls in <tool_call> tags, tool results in <tool_response> tags (written
for the tests; the default model's GGUF has no template of its own)."""

TOOL_TEMPLATE = """\
{%- if tools %}<start_of_turn>user
You may call these functions. Each is described as JSON:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}To call one, answer with nothing but
<tool_call>{"name": "FUNCTION", "arguments": {ARGUMENTS}}</tool_call><end_of_turn>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<start_of_turn>user
<tool_response>{{ m.content }}</tool_response><end_of_turn>
{% elif m.role == "assistant" %}<start_of_turn>model
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.function.name | tojson \
}}, "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<end_of_turn>
{% else %}<start_of_turn>user
{{ m.content }}<end_of_turn>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "maxLength": 32}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
