"""The tests of `rpg_trl.async_rpg` on a TRL older than it needs: the library supports a window of TRL releases
(`rpg_trl.trl_release.TRL_WINDOW`), and the asynchronous trainer only its releases from TRL 1.16 (`ASYNC_TRL`), so on
an older one (.ci/trl_floor) its tests skip with the library's own refusal as the reason. The skip is decided by the
release alone (`require_async_trl`), never by an import that fails: a broken import on TRL 1.16 still fails."""

import pytest

from rpg_trl.trl_release import require_async_trl


def async_trl_missing() -> str:
    """The library's refusal of the installed TRL for `rpg_trl.async_rpg` (empty when the release serves)."""
    try:
        require_async_trl()
    except ImportError as exc:
        return str(exc)
    return ""


def skip_module_without_async_trl() -> None:
    """Skip the calling test module when the installed TRL is older than `rpg_trl.async_rpg` needs; call it before the
    module imports `trl.experimental.async_grpo` or `rpg_trl.async_rpg`."""
    reason = async_trl_missing()
    if reason:
        pytest.skip(reason, allow_module_level=True)


#: The mark of a single test that needs `rpg_trl.async_rpg` in a module whose other tests run on every TRL release.
needs_async_trl = pytest.mark.skipif(bool(async_trl_missing()), reason=async_trl_missing() or "TRL 1.16 or later")
