"""Offline commands, apart from serving: `tpu-models export` (export.py) and
`tpu-models compile` (compile.py, its report and advice)."""
