# Run from the project root: .venv/bin/python scripts/trl_peer_suite/summarize.py [trl.xml st.xml] [--json OUT.json]
"""Compare the two junit files of run_tests.sh: TRL's trainers (trl) vs shardtrain.trl's (st).

Prints the counts per side, then the tests that pass under trl and fail (or error) under st grouped by their first
error line under st (exception type + message, shortened; digits, addresses and tmp paths folded for grouping),
most frequent first, then the most frequent first error lines of tests failing under trl (stand-in gaps, version
skew; excluded from the comparison). Writes the whole comparison as JSON (default: summary.json beside trl.xml).
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

BAD = ("failed", "error")


def first_line(child) -> str:
    msg = (child.get("message") or "").strip() or (child.text or "").strip()
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if not lines:
        return ""
    line = lines[0]
    m = re.match(r'failed on (setup|teardown) with "(.*)', line)  # xunit1 errors: 'failed on setup with "..."'
    if m:  # the first "E   ..." line of the report says more than the file/line the message starts with
        e_lines = [ln[1:].strip() for ln in (child.text or "").splitlines() if re.match(r"E\s", ln)]
        line = f"[{m.group(1)}] " + (e_lines[0] if e_lines else m.group(2).rstrip('"'))
    return line


def group_key(line: str) -> str:
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"/tmp/\S+", "<tmp>", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return line[:140]


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        tid = f"{tc.get('classname')}::{tc.get('name')}"
        kind, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg = first_line(child)
                break
        if tid in out and out[tid][0] in BAD:  # call failure + teardown error: keep the first
            continue
        out[tid] = (kind, msg)
    return out


def short(tid: str) -> str:
    cls, name = tid.split("::", 1)
    return f"{cls.split('.')[-1]}::{name}"


def grouped(tests: list[str], res: dict[str, tuple[str, str]]) -> list[dict]:
    groups: dict[str, list[str]] = defaultdict(list)
    for t in tests:
        groups[group_key(res[t][1])].append(t)
    return [{"first_error_line": res[ts[0]][1][:300], "count": len(ts), "tests": ts}
            for _, ts in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def main(argv: list[str]) -> None:
    out_json = None
    if "--json" in argv:
        i = argv.index("--json")
        out_json, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    trl_path, st_path = (argv + ["/tmp/peer-trl/results/trl.xml", "/tmp/peer-trl/results/st.xml"][len(argv) :])[:2]
    trl, st = outcomes(trl_path), outcomes(st_path)
    ids = sorted(set(trl) | set(st))

    counts = {}
    print("| side | passed | failed | error | skipped | total |\n|---|---|---|---|---|---|")
    for name, res in (("trl", trl), ("st", st)):
        c = Counter(k for k, _ in res.values())
        counts[name] = {**{k: c[k] for k in ("passed", "failed", "error", "skipped")}, "total": len(res)}
        print(f"| {name} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | {len(res)} |")

    both = [t for t in ids if trl.get(t, ("",))[0] == "passed" and st.get(t, ("",))[0] == "passed"]
    regress = [t for t in ids if trl.get(t, ("",))[0] == "passed" and st.get(t, ("missing",))[0] in BAD]
    skipped_st = [t for t in ids if trl.get(t, ("",))[0] == "passed" and st.get(t, ("missing",))[0] == "skipped"]
    gained = [t for t in ids if trl.get(t, ("missing",))[0] in BAD and st.get(t, ("",))[0] == "passed"]
    trl_bad = [t for t in ids if trl.get(t, ("missing",))[0] in BAD]
    print(f"\npassed under trl: {counts['trl']['passed']}   passed under st: {counts['st']['passed']}   "
          f"passed under both: {len(both)}   passed under trl, failed/error under st: {len(regress)}   "
          f"passed under trl, skipped under st: {len(skipped_st)}   failed under trl, passed under st: {len(gained)}")

    reg_groups = grouped(regress, st)
    print(f"\n## passed under trl, failed under st: {len(regress)}, by first error line under st\n")
    print("| count | first error line (st) | examples |\n|---|---|---|")
    for g in reg_groups:
        ex = ", ".join(short(t) for t in g["tests"][:3])
        print(f"| {g['count']} | {g['first_error_line'][:160].replace('|', '/')} | {ex} |")

    trl_groups = grouped(trl_bad, trl)
    print(f"\n## failed under trl (excluded from the comparison): {len(trl_bad)}, top first error lines\n")
    print("| count | first error line (trl) | example |\n|---|---|---|")
    for g in trl_groups[:25]:
        print(f"| {g['count']} | {g['first_error_line'][:160].replace('|', '/')} | {short(g['tests'][0])} |")

    summary = {"trl_xml": trl_path, "st_xml": st_path, "counts": counts, "passed_both": len(both),
               "passed_trl_failed_st": len(regress), "passed_trl_skipped_st": skipped_st,
               "failed_trl_passed_st": gained, "regressions_by_first_line": reg_groups,
               "trl_failures_by_first_line": trl_groups}
    dest = Path(out_json) if out_json else Path(trl_path).with_name("summary.json")
    dest.write_text(json.dumps(summary, indent=1))
    print(f"\nJSON: {dest}")


if __name__ == "__main__":
    main(sys.argv[1:])
