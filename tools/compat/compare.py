"""Compare two junit-xml results of one upstream suite: stock against fastpersist.

    python tools/compat/compare.py STOCK.xml FASTPERSIST.xml

Prints the counts of each run (passed, failed/errored, skipped) and every test whose
outcome differs, most important first: passes stock and fails with fastpersist, then
the others. Exit status 1 when some test passes stock and fails with fastpersist
(whether explained or not: docs/compat.md explains the deliberate ones), else 0.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Dict


def outcomes(path: str) -> Dict[str, str]:
    """Map 'classname::name' to passed / failed / skipped for every testcase in a junit file."""
    result: Dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        # A test can appear twice (an error in teardown after a pass): the worst wins.
        if result.get(key) != "failed":
            result[key] = outcome
    return result


def main(argv: list) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    stock, fast = outcomes(argv[1]), outcomes(argv[2])
    for label, res in (("stock", stock), ("fastpersist", fast)):
        c = Counter(res.values())
        print(f"{label:12s} passed {c['passed']:5d}  failed {c['failed']:4d}  skipped {c['skipped']:4d}  total {len(res)}")
    regressions = sorted(k for k in stock if stock[k] == "passed" and fast.get(k) == "failed")
    others = sorted(k for k in set(stock) | set(fast)
                    if stock.get(k) != fast.get(k) and k not in regressions)
    print(f"passes stock, fails with fastpersist: {len(regressions)}")
    for k in regressions:
        print("  REGRESSION", k)
    print(f"other differences: {len(others)}")
    for k in others:
        print(f"  {stock.get(k, 'absent')} -> {fast.get(k, 'absent')}  {k}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
