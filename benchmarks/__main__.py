"""The runner: `python -m benchmarks SUITE [flags]` runs one suite, writes its result (JSON: the data,
the git revision, the CPU, the package versions, the command) and prints its tables;
`python -m benchmarks render [--check]` makes benchmarks/RESULTS.md from the stored results.

    python -m benchmarks                              # the suites
    python -m benchmarks plan                         # -> benchmarks/results/plan.json
    python -m benchmarks plan --quick --in-process    # seconds: does the suite still run?
    python -m benchmarks forward --against HEAD~1     # ours at the working tree vs a revision
    python -m benchmarks SUITE --help                 # what it measures, its flags

The flags every suite shares are declared here once (`add_shared`); a suite adds its own.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

from benchmarks import common, render
from benchmarks.registry import SUITES

RAW = argparse.RawDescriptionHelpFormatter


def add_shared(p: argparse.ArgumentParser, module) -> None:
    """The shared flags, as `module` takes them (--repeats / --rounds where it has DEFAULTS for them,
    --against where it has AGAINST)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="the tiny towers and the fewest calls: seconds, to see that the suite runs (its figures mean "
        "nothing); written under results/quick/",
    )
    if hasattr(module, "AGAINST"):
        p.add_argument("--against", metavar="REV", help=module.AGAINST)
    for flag, (full, quick) in getattr(module, "DEFAULTS", {}).items():
        what = {"repeats": "timed calls per case and process", "rounds": "rounds of processes, sides alternating"}
        p.add_argument(f"--{flag}", type=int, metavar="N", help=f"{what[flag]} (default {full}; --quick {quick})")
    p.add_argument(
        "--label", help="a result beside the suite's own: results/SUITE-LABEL.json (a page section of its own)"
    )
    p.add_argument(
        "--note", action="append", default=[], help="a line under the result's tables on the page (repeatable)"
    )
    p.add_argument("--out", type=pathlib.Path, help="the JSON to write instead of results/[quick/]SUITE[-LABEL].json")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the workers in this process where they need no other interpreter or PYTHONPATH (quick checks)",
    )


def build_parser(suite: str | None = None) -> argparse.ArgumentParser:
    """The runner's parser; only `suite`'s module is imported (its flags), the others are listed."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, formatter_class=RAW)
    sub = ap.add_subparsers(dest="suite", metavar="SUITE")
    for name, s in SUITES.items():
        if name != suite:
            sub.add_parser(name, help=s.about, add_help=False)
            continue
        module = s.module()
        p = sub.add_parser(name, help=s.about, description=module.__doc__, formatter_class=RAW)
        add_shared(p, module)
        module.add_args(p)
    p = sub.add_parser("render", help="benchmarks/RESULTS.md from the stored results", description=render.__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is not what the renderer makes")
    return ap


def result_path(suite: str, label: str | None, quick: bool) -> pathlib.Path:
    return common.RESULTS / ("quick" if quick else "") / f"{suite}{'-' + label if label else ''}.json"


def command(argv: list[str]) -> str:
    """The command line that reproduces a run (its --out, --note and --in-process left out)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--note"):
            skip = True
        elif a != "--in-process" and not a.startswith(("--out=", "--note=")):
            kept.append(a)
    return shlex.join(["python", "-m", "benchmarks", *kept])


def run_suite(args, argv: list[str]) -> dict:
    """Run the suite `args` names; its result, written to its JSON."""
    module = SUITES[args.suite].module()
    for flag, (full, quick) in getattr(module, "DEFAULTS", {}).items():
        if getattr(args, flag) is None:
            setattr(args, flag, quick if args.quick else full)
    common.IN_PROCESS = args.in_process
    started = common.now()
    data = module.run(args)  # may set args.label (e.g. --against: against-REV)
    result = {
        "suite": args.suite,
        "label": args.label,
        "command": command(argv),
        "quick": args.quick,
        "started": started,
        "date": common.now(),
        "revision": common.tree_info(),
        "machine": common.machine(),
        "versions": common.installed_versions(),
        "notes": args.note,
        "data": data,
    }
    result = json.loads(json.dumps(result))  # the report reads what is stored (string keys)
    out = args.out or result_path(args.suite, args.label, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    print(f"\n{common.describe_machine(result['machine'])}\n\n{module.report(result)}\n")
    common.log(f"wrote {out}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and argv[0] in SUITES else None)
    args = parser.parse_args(argv)
    if args.suite is None:
        width = max(map(len, SUITES))
        print("python -m benchmarks SUITE [--quick] [--against REV] ...   (SUITE --help: its flags)\n")
        print("\n".join(f"  {n:<{width}}  {s.about}" for n, s in SUITES.items()))
        print(f"  {'render':<{width}}  benchmarks/RESULTS.md from the stored results")
        return 0
    if args.suite == "render":
        return render.main(check=args.check)
    run_suite(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
