"""The files this project's tools write in a folder, and the one rule for writing there.

A tool writes only into a folder that is empty or holds nothing but files of this project's
tools: a run's (train.py's), diagnose.py's, compare.py's mark, bench.py's report. A config.json
counts as a run's only when it holds a run's settings, not a model's or a user's own. Of a tool's
own outputs, one already there is replaced only when asked (--overwrite; train.py's --resume
continues it). train.py (start.prepare_out), diagnose.py, bench.py --gpu-report and compare.py
(run_settings) all ask here. Needs: tasks.py (DataError). All engineering."""
import json
import os
import re

from engineering.tasks import DataError

# a run's results: an --out holding one is refused unless --resume or --overwrite
RESULTS = ("metrics.jsonl", "samples.jsonl", "checkpoint", "checkpoint.old", "reference")
# what else a run writes in --out (or a kill leaves there): --overwrite removes these too
LEFTOVERS = ("checkpoint.tmp", "reference.tmp", "reference.old", "tiny-init", "metrics.jsonl.tmp",
             "samples.jsonl.tmp", "config.json", "config.json.tmp")
FINISHED = "finished"  # compare.py's mark of a run that ended: its --seconds
DIAGNOSE = {"values": ("diagnose.jsonl", "diagnose.png"), "trace": ("trace.json", "trace.png"),
            "mc_settings": ("mc_settings.json",),
            "newline_odds": ("newline_odds.json",)}  # diagnose.py's, by default in the run's folder
REPORT = ("gpu-report.json", "gpu-report.md")  # bench.py --gpu-report's
# the run's lock, the tiny model being built at its start, and all of the above
OURS = set(RESULTS + LEFTOVERS + REPORT + sum(DIAGNOSE.values(), ())
           + (FINISHED, ".lock", "tiny-init.tmp"))


def run_settings(folder: str) -> dict | None:
    """The settings in folder/config.json when they are a run's, else None."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        return None
    return settings if is_run_settings(settings) else None


def is_run_settings(settings) -> bool:
    """A run's settings as train.py records them: a JSON object with --iterations, --algo, --out.

    A model's config.json has none of them."""
    return (isinstance(settings, dict) and isinstance(settings.get("iterations"), int)
            and isinstance(settings.get("algo"), str) and isinstance(settings.get("out"), str))


def ours(folder: str, name: str) -> bool:
    """Whether folder/name is a file of this project's tools (a .tmp of one: a write that was
    killed; .writableN: start.prepare_out's probe)."""
    if name == "config.json":
        return run_settings(folder) is not None
    return name.removesuffix(".tmp") in OURS or re.fullmatch(r"\.writable\d+", name) is not None


def refuse_foreign(folder: str, flag: str):
    """One line (DataError) naming the first thing in `folder` that no tool of this project
    writes; nothing when the folder is missing, empty, or all of it is ours."""
    if not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        if not ours(folder, name):
            what = ("is not a run's settings (a model's, or your own)" if name == "config.json"
                    else "no tool of this project writes")
            raise DataError(f"{flag} {folder!r} holds {name!r}, which {what}: nothing is written "
                            "there; choose an empty folder, or one of this project's")


def refuse_earlier(folder: str, flag: str, outputs, replace: bool, what: str, hint: str):
    """One line (DataError) when `folder` holds any of a tool's `outputs` and the tool was not
    asked to `replace` them: it names them, `what` they are and the `hint`."""
    found = [name for name in outputs if os.path.exists(os.path.join(folder, name))]
    if found and not replace:
        raise DataError(f"{flag} {folder!r} holds {what} ({', '.join(found)}): {hint}")


def claim(folder: str, flag: str, outputs, overwrite: bool, what: str):
    """Both rules, for a tool that writes `outputs` into `folder` and replaces them with
    --overwrite."""
    refuse_foreign(folder, flag)
    refuse_earlier(folder, flag, outputs, overwrite, what, "pass --overwrite to replace it")
