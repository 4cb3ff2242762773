"""Render the DeepSpeed key table (`deepspeed_keys.py`) as docs/reference/config.md.

    python -m shardwise.config.key_docs > docs/reference/config.md

tests/unit/test_config_keys.py fails when the committed page differs from this rendering.
"""

from __future__ import annotations

from . import deepspeed_keys as ds
from .auto import PLACEHOLDER

_INTRO = f"""# DeepSpeed config keys in shardwise

shardwise runs DeepSpeed 0.19.8 configs unchanged. This page lists what it does with each key DeepSpeed
reads; it is generated from `src/shardwise/config/deepspeed_keys.py` (`python -m shardwise.config.key_docs >
docs/reference/config.md`), and `tests/unit/test_config_keys.py` feeds every key of DeepSpeed's own catalogue
(`tests/data/deepspeed_0_19_8_config_keys.json`, extracted by `tools/deepspeed_config_keys.py`) through the
parser. `section.*` stands for a section and every key in it; a more specific row wins.

- **implemented**: shardwise acts on the key.
- **no-op**: accepted with no effect, for the reason given (noted once per job at INFO level, by rank 0, and only
  where DeepSpeed would read the key at the configured ZeRO stage and offload device).
- **no-op (warned)**: accepted, but it asks for output shardwise does not produce (warned once).
- **refused**: a feature shardwise does not have that would change what is trained or where memory goes:
  "a DeepSpeed setting that shardwise does not implement yet ...". A section that asks for nothing
  (`{{"enabled": false}}`, `false`, an offload to `"none"`; for sections marked *unless enabled*, anything
  without an `"enabled": true` inside; `tensor_parallel` without `autotp_size` > 0) is dropped quietly.
  Keys with *accepts* are refused only for other values: the accepted ones are what shardwise always does.

Unknown keys (typos) are refused with a "did you mean".

**"auto"**: Hugging Face's Trainer and accelerate replace it before they call `initialize`, so an "auto"
that reaches shardwise was written by hand. In the batch-size keys it is derived from the others; in the
keys marked *auto: default* it takes DeepSpeed's default (what DeepSpeed itself does); at no-op keys it is
ignored; the values used are logged once. Anywhere else guessing would change the numerics, and every
such key is listed in one error: {PLACEHOLDER}.
"""


def render() -> str:
    lines = [_INTRO]
    for kind in (ds.IMPLEMENTED, ds.NO_OP, ds.WARNED, ds.REFUSED):
        rows = sorted((k, t) for k, t in ds.TABLE.items() if t.kind == kind)
        lines += [f"## {kind.capitalize()} ({len(rows)} entries)", "", "| key | why / how |", "| --- | --- |"]
        lines += [f"| `{key}` | {_describe(t)} |" for key, t in rows]
        lines.append("")
    lines += ["## Other spellings", "", "Both spellings are accepted; two spellings of one key with different values are",
              "an error.", "", "| DeepSpeed spelling | shardwise field |", "| --- | --- |"]
    lines += [f"| `{alias}` | `{target}` |" for alias, target in sorted(ds.ALIASES.items())]
    return "\n".join(lines) + "\n"


def _describe(t: ds.Treatment) -> str:
    notes = []
    if t.accepts is not None:
        notes.append("accepts " + " or ".join(f"`{_json(a)}`" for a in t.accepts))
    if t.off != ds.DISABLED:
        notes.append({ds.UNLESS_ENABLED: "quiet unless enabled", ds.UNLESS_AUTOTP: "quiet unless autotp_size > 0"}[t.off])
    if t.auto is not None:
        notes.append(f"auto: {t.auto}")
    prefix = f"*{'; '.join(notes)}* — " if notes else ""
    return prefix + t.reason.replace("|", "\\|")


def _json(value: object) -> str:
    from .compat import shown

    return shown(value)


if __name__ == "__main__":
    print(render(), end="")
