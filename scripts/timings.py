#!/usr/bin/env python3
"""Prints where a build-and-test run spent its time (scripts/test.sh calls it at the end).

  timings.py LABEL BUILD_DIR NINJA_LOG_SKIP BUILD_WALL_S TEST_WALL_S JUNIT_XML

Compile units and links come from BUILD_DIR/.ninja_log (the lines after the first
NINJA_LOG_SKIP, this run's), tests from ctest's JUnit report. The configure step is the build
script's wall time less ninja's.
"""
import os
import sys
import xml.etree.ElementTree as ET


def main():
    label, build, skip, build_wall, test_wall, junit = sys.argv[1:7]
    skip, build_wall, test_wall = int(skip), float(build_wall), float(test_wall)
    compiles, links = [], []
    log = os.path.join(build, ".ninja_log")
    if os.path.exists(log):
        with open(log) as f:
            raw = f.read().splitlines()
        if len(raw) < skip:  # ninja rewrote (recompacted) the log: take it whole
            skip = 0
        lines = [l for l in raw[skip:] if l and not l.startswith("#")]
        starts, ends = [], []
        for line in lines:
            parts = line.split("\t")
            if len(parts) < 4:
                continue
            start, end, target = int(parts[0]), int(parts[1]), parts[3]
            starts.append(start)
            ends.append(end)
            secs = (end - start) / 1000.0
            if target.endswith((".o", ".gch")):  # a unit, or a precompiled header
                compiles.append((secs, target))
            elif not target.endswith((".txt", ".cmake", ".stamp")) and "/CMakeFiles/" not in target:
                links.append((secs, target))
        ninja_wall = (max(ends) - min(starts)) / 1000.0 if starts else 0.0
    else:
        ninja_wall = 0.0
    tests = []
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            tests.append((float(case.get("time", "0")), case.get("name", "?")))

    def top(items, n=10):
        return sorted(items, reverse=True)[:n]

    print(f"== timings: {label}")
    print(f"configure   {max(0.0, build_wall - ninja_wall):8.1f} s")
    print(f"build       {ninja_wall:8.1f} s wall: {len(compiles)} compile units "
          f"({sum(s for s, _ in compiles):.0f} s summed), {len(links)} links "
          f"({sum(s for s, _ in links):.0f} s summed) on {os.cpu_count()} cores")
    print(f"tests       {test_wall:8.1f} s wall: {len(tests)} tests "
          f"({sum(s for s, _ in tests):.0f} s summed)")
    for title, items in (("slowest compile units", compiles), ("slowest links", links),
                         ("slowest tests", tests)):
        if not items:
            continue
        print(f"  {title}:")
        for secs, name in top(items):
            print(f"    {secs:7.1f} s  {name}")


if __name__ == "__main__":
    main()
