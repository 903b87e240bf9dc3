# Run from the project root:
#   .venv/bin/python scripts/st_peer_suite/summarize.py [sbert.xml shardtrain.xml] [--out DIFF.txt]
"""Compare the two junit files of run_tests.sh: sentence-transformers' trainers (sbert) vs shardtrain's (shardtrain).

(scripts/trl_peer_suite/summarize.py groups by the first error line only and names its sides trl/st; this one also
keys each group on the shardtrain frame nearest the error.)
Prints the counts per side, then the tests that pass under sbert and fail (or error) under shardtrain, grouped by
their first error under shardtrain: exception type + the first line of its message (digits, addresses and tmp paths
folded for grouping) + the shardtrain frame nearest the error (the innermost traceback entry in the installed
shardtrain package, file:line; "-" when none is in the traceback), most frequent first; then the tests failing on
both sides whose shardtrain error differs from sbert's (sbert failed late, shardtrain maybe earlier), and the most
frequent first errors under sbert (stand-in gaps, version skew; excluded from the comparison).
Writes the full grouping, every test id listed, to DIFF.txt (default: diff.txt beside sbert.xml) and the whole
comparison as JSON (summary.json beside it).
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

BAD = ("failed", "error")
# a traceback entry in the shardtrain package ("…/src/shardtrain/train/compose.py:88: in train"), not in the
# side's test tree (/tmp/peer-st/shardtrain/tests/…)
FRAME = re.compile(r"(?:^|[\s/])(shardtrain/(?!tests/)[\w/]+\.py):(\d+):")
TYPE = re.compile(r"^([\w.]+(?:Error|Exception|Exit|Interrupt|Warning|Failed|Timeout)|Failed|KeyboardInterrupt)\b")


def first_error(child) -> tuple[str, str]:
    """(exception type + first message line, shardtrain frame nearest the error)."""
    text = child.text or ""
    msg = (child.get("message") or "").strip() or text.strip()
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    e_lines = [ln[1:].strip() for ln in text.splitlines() if re.match(r"E\s", ln)]
    m = re.match(r'failed on (setup|teardown) with "(.*)', line)  # xunit1 errors: 'failed on setup with "..."'
    if m:
        line = f"[{m.group(1)}] " + (e_lines[0] if e_lines else m.group(2).rstrip('"'))
    elif not TYPE.match(line):  # pytest's message for a failed `assert` lacks the type: take it from the last entry
        last = re.findall(r"^\S+:\d+: (\w+)$", text, re.M)
        if last:
            line = f"{last[-1]}: {line}"
    frames = FRAME.findall(text)
    frame = f"{frames[-1][0]}:{frames[-1][1]}" if frames else "-"
    return line, frame


def group_key(line: str, frame: str) -> str:
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"/tmp/\S+", "<tmp>", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return f"{line[:140]} @ {frame}"


def outcomes(path: str) -> dict[str, tuple[str, str, str]]:
    out: dict[str, tuple[str, str, str]] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        tid = f"{tc.get('classname')}::{tc.get('name')}"
        kind, msg, frame = "passed", "", "-"
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg, frame = first_error(child) if kind in BAD else ((child.get("message") or "").strip(), "-")
                break
        if tid in out and out[tid][0] in BAD:  # call failure + teardown error: keep the first
            continue
        out[tid] = (kind, msg, frame)
    return out


def short(tid: str) -> str:
    cls, name = tid.split("::", 1)
    return f"{cls.split('.')[-1]}::{name}"


def grouped(tests: list[str], res: dict[str, tuple[str, str, str]]) -> list[dict]:
    groups: dict[str, list[str]] = defaultdict(list)
    for t in tests:
        groups[group_key(res[t][1], res[t][2])].append(t)
    return [{"first_error": res[ts[0]][1][:300], "frame": res[ts[0]][2], "count": len(ts), "tests": ts}
            for _, ts in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def main(argv: list[str]) -> None:
    out_txt = None
    if "--out" in argv:
        i = argv.index("--out")
        out_txt, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    a_path, b_path = (argv + ["/tmp/peer-st/results/sbert.xml", "/tmp/peer-st/results/shardtrain.xml"][len(argv) :])[:2]
    a, b = outcomes(a_path), outcomes(b_path)
    ids = sorted(set(a) | set(b))
    get = lambda res, t: res.get(t, ("missing", "", "-"))[0]  # noqa: E731

    counts = {}
    report = ["| side | collected | passed | failed | error | skipped |", "|---|---|---|---|---|---|"]
    for name, res in (("sbert", a), ("shardtrain", b)):
        c = Counter(k for k, _, _ in res.values())
        counts[name] = {"collected": len(res), **{k: c[k] for k in ("passed", "failed", "error", "skipped")}}
        report.append(f"| {name} | {len(res)} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |")

    both = [t for t in ids if get(a, t) == "passed" and get(b, t) == "passed"]
    regress = [t for t in ids if get(a, t) == "passed" and get(b, t) in BAD]
    skipped_b = [t for t in ids if get(a, t) == "passed" and get(b, t) == "skipped"]
    missing_b = [t for t in ids if get(a, t) == "passed" and get(b, t) == "missing"]
    gained = [t for t in ids if get(a, t) in BAD and get(b, t) == "passed"]
    a_bad = [t for t in ids if get(a, t) in BAD]
    both_bad_diff = [t for t in a_bad if get(b, t) in BAD and group_key(a[t][1], "") != group_key(b[t][1], "")]
    report.append(f"\npassed under both: {len(both)}   passed under sbert, failed/error under shardtrain: "
                  f"{len(regress)}   passed under sbert, skipped under shardtrain: {len(skipped_b)}   "
                  f"passed under sbert, absent under shardtrain: {len(missing_b)}   "
                  f"failed under sbert, passed under shardtrain: {len(gained)}")

    reg_groups = grouped(regress, b)
    report.append(f"\n## passed under sbert, failed under shardtrain: {len(regress)}, by first error under shardtrain "
                  "(type: first message line @ shardtrain frame nearest the error)\n")
    report.append("| count | first error (shardtrain) | shardtrain frame | examples |\n|---|---|---|---|")
    for g in reg_groups:
        ex = ", ".join(short(t) for t in g["tests"][:3])
        report.append(f"| {g['count']} | {g['first_error'][:160].replace('|', '/')} | {g['frame']} | {ex} |")

    diff_groups = grouped(both_bad_diff, b)
    report.append(f"\n## failed under both, shardtrain's first error differs from sbert's: {len(both_bad_diff)}\n")
    report.append("| count | first error (shardtrain) | shardtrain frame | example (its sbert error) |")
    report.append("|---|---|---|---|")
    for g in diff_groups:
        t = g["tests"][0]
        report.append(f"| {g['count']} | {g['first_error'][:140].replace('|', '/')} | {g['frame']} | "
                      f"{short(t)} ({a[t][1][:80].replace('|', '/')}) |")

    a_groups = grouped(a_bad, a)
    report.append(f"\n## failed under sbert (excluded from the comparison): {len(a_bad)}, by first error\n")
    report.append("| count | first error (sbert) | example |\n|---|---|---|")
    for g in a_groups[:30]:
        report.append(f"| {g['count']} | {g['first_error'][:160].replace('|', '/')} | {short(g['tests'][0])} |")
    print("\n".join(report))

    full = [f"sbert: {a_path}", f"shardtrain: {b_path}", ""] + report[:5]
    full.append(f"\n# passed under sbert, failed under shardtrain: {len(regress)} tests in {len(reg_groups)} groups\n")
    for i, g in enumerate(reg_groups, 1):
        full.append(f"## {i}. {g['count']} x {g['first_error']}\n   at {g['frame']}")
        full += [f"   - {t}" for t in g["tests"]]
        full.append("")
    for title, tests in (("passed under sbert, skipped under shardtrain", skipped_b),
                         ("passed under sbert, absent under shardtrain", missing_b),
                         ("failed under sbert, passed under shardtrain", gained)):
        full.append(f"# {title}: {len(tests)}")
        full += [f"   - {t}  ({b.get(t, ('', '', ''))[1][:120] or a.get(t, ('', '', ''))[1][:120]})" for t in tests]
        full.append("")
    full.append(f"# failed under both, shardtrain's first error differs from sbert's: {len(both_bad_diff)}\n")
    for g in diff_groups:
        full.append(f"## {g['count']} x {g['first_error']}\n   at {g['frame']}")
        full += [f"   - {t}  (sbert: {a[t][1][:160]})" for t in g["tests"]]
        full.append("")
    full.append(f"# failed under sbert: {len(a_bad)}\n")
    for g in a_groups:
        full.append(f"## {g['count']} x {g['first_error']}")
        full += [f"   - {t}  (shardtrain: {get(b, t)})" for t in g["tests"]]
        full.append("")
    dest = Path(out_txt) if out_txt else Path(a_path).with_name("diff.txt")
    dest.write_text("\n".join(full) + "\n")

    summary = {"sbert_xml": a_path, "shardtrain_xml": b_path, "counts": counts, "passed_both": len(both),
               "passed_sbert_failed_shardtrain": len(regress), "passed_sbert_skipped_shardtrain": skipped_b,
               "passed_sbert_absent_shardtrain": missing_b, "failed_sbert_passed_shardtrain": gained,
               "regressions_by_first_error": reg_groups, "failed_both_different_error": diff_groups,
               "sbert_failures_by_first_error": a_groups}
    dest.with_name("summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nfull grouping: {dest}   JSON: {dest.with_name('summary.json')}")


if __name__ == "__main__":
    main(sys.argv[1:])
