"""Test-side helpers, imported as `helpers.<module>` (pytest puts `tests/` on `sys.path`). Nothing in `rpg_trl/`
imports them. Some also run as scripts in subprocesses (`python tests/helpers/crash_worker.py ...`,
`torch.distributed.run ... tests/helpers/mp_worker.py ...`); those that import another helper first put `tests/` on
`sys.path` themselves."""
