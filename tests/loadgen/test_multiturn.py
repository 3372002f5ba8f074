"""The multi-turn chat workload: a shared system prompt, conversations started open-loop, each
turn's prompt the conversation so far plus a new question; bad shapes refused before anything
is sent."""

from __future__ import annotations

import pytest

from orchestrator.cli.main import main
from orchestrator.loadgen.conversations import MultiTurn, build_conversations, parse_multiturn


def test_conversations_share_the_system_prompt_and_are_repeatable() -> None:
    shape = MultiTurn(4, 3, system_tokens=40, question_tokens=(5, 9), rate=2.0, seed=7)
    system, conversations = build_conversations(shape, vocab_size=100, excluded_ids=[0, 1])
    assert len(system) == 40 and not {0, 1} & set(system)
    assert [c.index for c in conversations] == [0, 1, 2, 3]
    starts = [c.start_s for c in conversations]
    assert starts[0] == 0.0 and starts == sorted(starts)
    for conversation in conversations:
        assert len(conversation.questions) == 3
        assert all(5 <= len(q) <= 9 and not {0, 1} & set(q) for q in conversation.questions)
    assert build_conversations(shape, 100, [0, 1]) == (system, conversations)
    fixed = MultiTurn(3, 2, rate=4.0, arrival="fixed")
    assert [c.start_s for c in build_conversations(fixed, 100)[1]] == [0.0, 0.25, 0.5]
    assert shape.longest_prompt() == 40 + 3 * 9 + 2 * 32


@pytest.mark.parametrize(
    ("spec", "options"),
    [
        ("uniform:1-2", {}),
        ("multiturn:4", {}),
        ("multiturn:x:3", {}),
        ("multiturn:0:3", {}),
        ("multiturn:4:3", {"question_tokens": (9, 5)}),
        ("multiturn:4:3", {"rate": 0.0}),
        ("multiturn:4:3", {"arrival": "burst"}),
    ],
)
def test_bad_shapes_are_refused(spec: str, options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        parse_multiturn(spec, **options)


def test_the_command_refuses_a_bad_shape_before_it_connects(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No router listens there: the refusal must come first.
    argv = ["bench", "multiturn", "--address", "127.0.0.1:9", "--question-tokens", "9-x"]
    assert main(argv) == 2
    assert "--question-tokens" in capsys.readouterr().err
