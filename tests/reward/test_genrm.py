import pytest

from pivotrl.reward import GenRM, JudgeStats, Outcome
from pivotrl.reward.genrm import judge_prompt


@pytest.fixture
def genrm() -> GenRM:
    return GenRM("Q:{question}\nR:{reference}\nA:{response}\nJ:", "VERDICT: *(yes|no)", {"yes": 1.0, "no": 0.0}, -0.5)


@pytest.mark.parametrize(
    "text, reward, outcome, label",
    [
        ("got 045 want 045: 0=0 4=4 5=5 same. VERDICT: yes", 1.0, Outcome.PARSED, "yes"),
        ("got 035 want 045: 0=0 3#4 5=5 differ. VERDICT: no", 0.0, Outcome.PARSED, "no"),
        ("VERDICT:yes", 1.0, Outcome.PARSED, "yes"),
        ("VERDICT: no ... on reflection VERDICT: yes", 1.0, Outcome.PARSED, "yes"),  # the last verdict counts
        ("", -0.5, Outcome.UNPARSABLE, None),
        ("\x00\x01 garbage ### yes no", -0.5, Outcome.UNPARSABLE, None),
        ("verdict: yes", -0.5, Outcome.UNPARSABLE, None),  # the pattern is case-sensitive as configured
        ("VERDICT: maybe", -0.5, Outcome.UNPARSABLE, None),
    ],
)
def test_score(genrm: GenRM, text: str, reward: float, outcome: Outcome, label: str | None) -> None:
    j = genrm.score(text)
    assert (j.reward, j.outcome, j.label) == (reward, outcome, label)


def test_truncated_judgment_gets_fallback_and_is_marked(genrm: GenRM) -> None:
    j = genrm.score("got 045 want 045: 0=0 4=4", truncated=True)
    assert (j.reward, j.outcome) == (-0.5, Outcome.TRUNCATED)
    # a verdict written before the cut still counts
    assert genrm.score("VERDICT: yes and then", truncated=True).outcome is Outcome.PARSED


def test_label_without_reward_is_counted_not_fatal() -> None:
    g = GenRM("{response}", r"VERDICT: *(\w+)", {"yes": 1.0, "no": 0.0}, 0.25)
    j = g.score("VERDICT: maybe")
    assert (j.reward, j.outcome, j.label) == (0.25, Outcome.UNKNOWN_LABEL, "maybe")


def test_stats_count_failures(genrm: GenRM) -> None:
    stats = JudgeStats()
    for text, trunc in [("VERDICT: yes", False), ("VERDICT: no", False), ("junk", False), ("got", True)]:
        stats.add(genrm.score(text, trunc))
    assert stats.total == 4
    assert stats.parse_failures == 2
    assert stats.by_outcome == {"parsed": 2, "unparsable": 1, "truncated": 1}
    assert stats.by_label == {"yes": 1, "no": 1}


def test_prompt_renders_all_fields(genrm: GenRM) -> None:
    assert genrm.prompt("07+38=", "45", "35") == "Q:07+38=\nR:45\nA:35\nJ:"


def test_prompt_in_the_judges_chat_template() -> None:
    """The filled-in template is the user message of the judge's chat template (judge.chat_template)."""
    chat = lambda prompt: f"<user>{prompt}</user><judge>"
    g = GenRM("Q:{question}\nR:{reference}\nA:{response}\nJ:", "VERDICT: *(yes|no)", {"yes": 1.0}, 0.0, chat)
    assert g.prompt("07+38=", "45", "35") == "<user>Q:07+38=\nR:45\nA:35\nJ:</user><judge>"
    assert judge_prompt(g.template, "07+38=", "45", "35", chat) == g.prompt("07+38=", "45", "35")
    assert judge_prompt("{response}?", "q", "r", "35") == "35?"


def test_pattern_needs_one_group() -> None:
    with pytest.raises(ValueError, match="exactly one capture group"):
        GenRM("{response}", "VERDICT: (yes)|(no)", {"yes": 1.0}, 0.0)
