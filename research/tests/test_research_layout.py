"""The research package's public names resolve: each name that `rpg_research.toy` exports (loaded on first use) is
there, those that come from the library's testing package (`rpg_trl.testing`: the tiny models, the training settings,
the fixed rollouts) included, and `rpg_research.cpu_rollouts` gives the testing package's CPU rollouts themselves. The
layout of both packages, read from their source, is checked by tests/test_layout.py."""


def test_toy_exports_resolve():
    import rpg_research.toy as toy

    for name in toy.__all__:
        assert getattr(toy, name) is not None, name


def test_the_names_that_moved_to_the_testing_package_are_the_same_objects():
    """What the research package re-exports is the testing package's code, not a copy of it."""
    import rpg_research.cpu_rollouts as research_rollouts
    import rpg_research.toy as toy
    import rpg_trl.testing as testing
    import rpg_trl.testing.cpu_rollouts as rollouts

    for name in ("build_char_tokenizer", "build_tiny_qwen3", "save_tiny_model", "make_fixed_rollout"):
        assert getattr(toy, name) is getattr(testing, name), name
    assert toy.no_activation_checkpointing is testing.no_activation_checkpointing
    for name in rollouts.__all__:
        assert getattr(research_rollouts, name) is getattr(rollouts, name), name
