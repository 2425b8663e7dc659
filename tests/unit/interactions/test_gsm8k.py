"""GSM8KInteraction: feedback per turn, termination on a correct answer, score, per-instance state."""

import asyncio

from mcore_agentic.interactions.gsm8k import GSM8KInteraction


def _assistant(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def test_incorrect_then_correct():
    async def main():
        inter = GSM8KInteraction({"name": "gsm8k", "max_user_turns": 3})
        iid = await inter.start_interaction(ground_truth="She has 3 + 4 = 7.\n#### 7")
        first = await inter.generate_response(iid, _assistant("I think #### 8"))
        score_after_first = await inter.calculate_score(iid)
        second = await inter.generate_response(iid, _assistant("Sorry: 3 + 4 = 7, so #### 7"))
        final = await inter.calculate_score(iid)
        await inter.finalize_interaction(iid)
        return inter, first, score_after_first, second, final, await inter.calculate_score(iid)

    inter, first, s1, second, final, released = asyncio.run(main())
    assert inter.max_user_turns == 3 and inter.name == "gsm8k"
    assert first == (False, "Your response is incorrect! You need to reflect on your answer and try again.", 0.0, {"turn": 1})
    assert s1 == 0.0
    assert second == (True, "Your response is correct!", 1.0, {"turn": 2})
    assert final == 1.0 and released == 0.0


def test_strict_format_and_instances_are_independent():
    async def main():
        inter = GSM8KInteraction({"name": "g", "answer_format": "strict"})
        a = await inter.start_interaction("a", ground_truth=7)
        b = await inter.start_interaction("b", ground_truth="12")
        bare = await inter.generate_response(a, _assistant("the answer is 7"))  # strict: no '####', no answer
        marked = await inter.generate_response(b, _assistant("#### 12"))
        multipart = await inter.generate_response(a, [{"role": "assistant", "content": [{"type": "text", "text": "#### 7"}]}])
        unknown = await inter.generate_response("nope", _assistant("#### 7"))
        return bare, marked, multipart, unknown

    bare, marked, multipart, unknown = asyncio.run(main())
    assert bare[0] is False and bare[2] == 0.0
    assert marked[0] is True and multipart[0] is True
    assert unknown[0] is True and "error" in unknown[3]  # a caller bug ends the episode instead of crashing


def test_exported_state_restores_an_interaction_in_a_fresh_object():
    async def main():
        inter = GSM8KInteraction({"name": "g", "max_user_turns": 3})
        iid = await inter.start_interaction("r", ground_truth=7)
        await inter.generate_response(iid, _assistant("#### 8"))
        state = inter.export_state(iid)
        fresh = GSM8KInteraction({"name": "g", "max_user_turns": 3})
        await fresh.start_interaction("r", ground_truth=7)
        fresh.import_state("r", state)
        return await fresh.generate_response("r", _assistant("#### 7"))

    done, _, score, extra = asyncio.run(main())
    assert done and score == 1.0 and extra == {"turn": 2}  # the turn counter continued
