"""load_tools: the shipped YAML files load; each kind of bad entry raises ConfigError naming tools[i].<field>."""

import copy
from pathlib import Path

import pytest

from mcore_agentic.tools.calculator import CalculatorTool
from mcore_agentic.tools.code_interpreter import PythonCodeTool
from mcore_agentic.tools.executor import LocalExecutor
from mcore_agentic.tools.gsm8k import GSM8KTool
from mcore_agentic.tools.registry import load_tools
from mcore_agentic.utils.errors import ConfigError
from tests.helpers.nested import apply_changes

REPO = Path(__file__).resolve().parents[3]
GOOD = {
    "class_name": "mcore_agentic.tools.calculator.CalculatorTool",
    "config": {},
    "tool_schema": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    },
}


class NotATool:
    def __init__(self, config, tool_schema):
        pass


class SyncTool:
    name = "sync"

    def __init__(self, config, tool_schema):
        pass

    def get_openai_tool_schema(self):
        return {}

    def create(self, instance_id=None, **kw):  # not async: rejected
        return "x"

    async def execute(self, instance_id, parameters, **kw):
        return None

    async def calc_reward(self, instance_id, **kw):
        return 0.0

    async def release(self, instance_id, **kw):
        return None


def _entry(**changes):
    return apply_changes(copy.deepcopy(GOOD), changes, delete=KeyError)


def test_shipped_yaml_files_load():
    classes = {"gsm8k": GSM8KTool, "calculator": CalculatorTool, "code": PythonCodeTool}
    executor = LocalExecutor(max_workers=1)
    try:
        for stem, cls in classes.items():
            tools = load_tools(REPO / f"configs/tools/{stem}_tool_config.yaml", executor=executor)
            (tool,) = tools.values()
            assert type(tool) is cls and tool.executor is executor
            assert tool.get_openai_tool_schema()["function"]["name"] == tool.name
    finally:
        executor.shutdown()


def test_inline_list_keeps_order_and_omegaconf_containers_work():
    from omegaconf import OmegaConf

    second = _entry(tool_schema__function__name="calc2")
    tools = load_tools(tools=OmegaConf.create([GOOD, second]))
    assert list(tools) == ["calculator", "calc2"]
    assert load_tools() == {}


@pytest.mark.parametrize(
    "entry, field, text",
    [
        (_entry(class_name="mcore_agentic.tools.nope.Tool"), "tools[0].class_name", "cannot import module"),
        (_entry(class_name="mcore_agentic.tools.calculator.Nope"), "tools[0].class_name", "no attribute 'Nope'"),
        (_entry(class_name="CalculatorTool"), "tools[0].class_name", "class path"),
        (_entry(class_name=f"{__name__}.NotATool"), "tools[0].class_name", "lacks get_openai_tool_schema"),
        (_entry(class_name=f"{__name__}.SyncTool"), "tools[0].class_name", "create must be 'async def'"),
        (_entry(class_name=KeyError), "tools[0].class_name", "class path"),
        (_entry(tool_schema=KeyError), "tools[0].tool_schema", "missing"),
        (_entry(tool_schema__type="tool"), "tools[0].tool_schema.type", "must be 'function'"),
        (_entry(tool_schema__function__name=KeyError), "tools[0].tool_schema.function.name", "got None"),
        (_entry(tool_schema__function__name="has space"), "tools[0].tool_schema.function.name", "letters, digits"),
        (_entry(tool_schema__function__parameters={"type": "array"}), "tools[0].tool_schema.function.parameters", "type 'object'"),
        (
            _entry(tool_schema__function__parameters={"type": "object", "properties": {"x": {"type": "strin"}}}),
            "tools[0].tool_schema.function.parameters",
            "not a valid JSON schema",
        ),
        (
            _entry(tool_schema__function__parameters__required=["expr"]),
            "tools[0].tool_schema.function.parameters.required",
            "'expr', which is not in properties",
        ),
        (_entry(config=[1]), "tools[0].config", "must be a mapping"),
        (_entry(config={"max_result_bitz": 5}), "tools[0].config.max_result_bitz", "did you mean"),
        (_entry(config={"max_result_bits": 0}), "tools[0].config.max_result_bits", "must be >= 1"),
        (_entry(schema={}), "tools[0].schema", "unknown key"),
    ],
)
def test_bad_entries_name_the_field(entry, field, text):
    with pytest.raises(ConfigError) as info:
        load_tools(tools=[entry])
    assert info.value.field == field, str(info.value)
    assert text in str(info.value)


def test_duplicate_names_are_rejected():
    with pytest.raises(ConfigError, match=r"tools\[1\].tool_schema.function.name.*duplicate tool name 'calculator' \(also tools\[0\]\)"):
        load_tools(tools=[GOOD, GOOD])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_tools(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("tools: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_tools(tmp_path / "bad.yaml")
    (tmp_path / "nokey.yaml").write_text("tool:\n  - {}\n")
    with pytest.raises(ConfigError, match=r"nokey.yaml: tools: missing"):
        load_tools(tmp_path / "nokey.yaml")
    (tmp_path / "entry.yaml").write_text("tools:\n  - class_name: mcore_agentic.tools.x.Y\n")
    with pytest.raises(ConfigError, match=r"entry.yaml: tools\[0\].class_name: cannot import"):
        load_tools(tmp_path / "entry.yaml")
    with pytest.raises(ConfigError, match="not both"):
        load_tools(tmp_path / "entry.yaml", tools=[GOOD])


def test_verl_dumped_schemas_with_null_keywords_load_and_validate():
    """verl's pydantic dumps write "enum": null, "items": null ...: dropped at load, never a call-time TypeError."""
    from mcore_agentic.rollout.tool_parser import ToolCall, validate_tool_call

    params = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": None, "enum": None},
            "digits": {"type": "array", "items": None, "default": None},
            "mode": {"type": "string", "enum": ["exact", None], "const": None},
        },
        "required": ["expression"],
    }
    entry = _entry(tool_schema__function__parameters=params, tool_schema__function__strict=False)
    tool = load_tools(tools=[entry])["calculator"]
    cleaned = tool.get_openai_tool_schema()["function"]["parameters"]["properties"]
    assert cleaned["expression"] == {"type": "string"}
    assert cleaned["digits"] == {"type": "array", "default": None}  # a null default is data, kept
    assert cleaned["mode"] == {"type": "string", "enum": ["exact", None], "const": None}
    assert validate_tool_call(ToolCall(name="calculator", arguments={"expression": "1+1"}, raw=""), {"calculator": tool}) is None
    bad = validate_tool_call(ToolCall(name="calculator", arguments={"expression": 2}, raw=""), {"calculator": tool})
    assert "must be of type string" in bad.message
    # a keyword that is wrong rather than null is rejected at load, in one line naming the field
    with pytest.raises(ConfigError) as info:
        load_tools(tools=[_entry(tool_schema__function__parameters__properties__expression={"type": "string", "enum": "x"})])
    assert info.value.field == "tools[0].tool_schema.function.parameters" and "not a valid JSON schema" in str(info.value)


class CountedTool(CalculatorTool):
    built = 0

    def __init__(self, config, tool_schema):
        type(self).built += 1
        super().__init__(config=config, tool_schema=tool_schema)


def test_instantiate_false_checks_every_entry_and_builds_none():
    """The pre-flight's mode: the checked schemas by name; no constructor runs, and a bad entry anywhere in the
    list fails before any tool is built (the code tool's constructor boots sandboxes)."""
    counted = _entry(class_name=f"{__name__}.CountedTool")
    schemas = load_tools(tools=[counted, _entry(tool_schema__function__name="calc2")], instantiate=False)
    assert list(schemas) == ["calculator", "calc2"] and schemas["calculator"]["function"]["name"] == "calculator"
    assert CountedTool.built == 0
    with pytest.raises(ConfigError, match=r"tools\[1\].tool_schema.function.name: duplicate tool name"):
        load_tools(tools=[counted, counted])
    assert CountedTool.built == 0
    executor = LocalExecutor(max_workers=1)
    try:
        assert load_tools(tools=[counted], executor=executor)["calculator"].executor is executor
    finally:
        executor.shutdown()
    assert CountedTool.built == 1
