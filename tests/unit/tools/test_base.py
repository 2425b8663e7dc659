"""safe_execute: a tool's exception or timeout becomes an error observation; result coercion; lifecycle defaults."""

import asyncio

from mcore_agentic.tools.base import BaseTool, ToolResponse, safe_execute

SCHEMA = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}


class ProbeTool(BaseTool):
    """Behaves as parameters["do"] says: raise, sleep, or return odd result types."""

    async def execute(self, instance_id, parameters, **kwargs):
        do = parameters["do"]
        if do == "raise":
            raise RuntimeError("backend exploded")
        if do == "raise_empty":
            raise KeyError()
        if do == "sleep":
            await asyncio.sleep(10)
        if do == "str":
            return "plain text"
        if do == "tuple":
            return ToolResponse(text="t", metrics={"a": 1}), 0.5, {"b": 2}
        if do == "int":
            return 3
        return ToolResponse(text=f"ok {self._instances[instance_id]['seed']}", reward=0.25)


def _run(params, timeout=None):
    async def main():
        tool = ProbeTool({}, SCHEMA)
        iid = await tool.create(seed=7)
        result = await safe_execute(tool, iid, params, timeout=timeout)
        await tool.release(iid)
        await tool.release(iid)  # releasing twice is harmless
        return result

    return asyncio.run(main())


def test_happy_path_and_lifecycle_defaults():
    result = _run({"do": "ok"})
    assert result == ToolResponse(text="ok 7", reward=0.25)
    tool = ProbeTool({"k": 1}, SCHEMA)
    assert tool.name == "probe" and tool.get_openai_tool_schema() is SCHEMA
    assert asyncio.run(tool.calc_reward("unknown")) == 0.0


def test_exception_becomes_error_observation():
    result = _run({"do": "raise"})
    assert result.is_error and result.reward == 0.0
    assert result.text == "Error: tool 'probe' failed: RuntimeError: backend exploded"
    assert "KeyError" in _run({"do": "raise_empty"}).text


def test_timeout_becomes_error_observation_and_returns_promptly():
    loop_time = []

    async def main():
        tool = ProbeTool({}, SCHEMA)
        start = asyncio.get_running_loop().time()
        result = await safe_execute(tool, "i", {"do": "sleep"}, timeout=0.2)
        loop_time.append(asyncio.get_running_loop().time() - start)
        return result

    result = asyncio.run(main())
    assert result.is_error and result.metrics["timeout"] == 1
    assert result.text == "Error: tool 'probe' timed out after 0.2 s."
    assert loop_time[0] < 2.0


def test_result_coercion():
    assert _run({"do": "str"}) == ToolResponse(text="plain text")
    assert _run({"do": "tuple"}) == ToolResponse(text="t", reward=0.5, metrics={"a": 1, "b": 2})
    bad = _run({"do": "int"})
    assert bad.is_error and "returned int; return a ToolResponse" in bad.text


def test_base_execute_not_implemented_is_an_observation():
    result = asyncio.run(safe_execute(BaseTool({}, SCHEMA), "i", {}))
    assert result.is_error and "NotImplementedError" in result.text
