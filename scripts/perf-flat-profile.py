#!/usr/bin/env python3
"""Flat profile, per process, of a `perf record` over wasmplane-perf or a release wasmplane.

perf 6.1 (Debian 12's) names no function of these binaries: lld puts their code at a virtual
address 0x1000 above its file offset, and perf looks symbols up by the offset. This resolves
the binary's samples itself (where its code is mapped, from the mmap events, then
addr2line) and
takes perf's names for everything else (libc, the kernel, compiled guests by file).

    perf record -o /tmp/p.data -F 400 BINARY ...          # --no-page-out for wasmplane-perf
    scripts/perf-flat-profile.py /tmp/p.data BINARY [TOP] [PROCESSES]

TOP functions (25) for each of the PROCESSES (3) with the most samples. Without call
graphs, so a function's share is its own time.
"""
import collections
import re
import subprocess
import sys

data, binary = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
processes = int(sys.argv[4]) if len(sys.argv) > 4 else 3

script = subprocess.run(
    ["perf", "script", "-i", data, "--show-mmap-events", "-F", "pid,ip,sym,dso", "--hide-call-graph"],
    capture_output=True, text=True, check=True,
).stdout
# Where the binary's code is mapped in each process, and the file offset mapped there.
code_mapping = re.compile(r"PERF_RECORD_MMAP2 (\d+)/\d+: \[0x([0-9a-f]+)\(0x[0-9a-f]+\) @ (0x[0-9a-f]+|0) .*\]: r-xp " + re.escape(binary) + "$")
# How far above its file offset the code segment's virtual address is (0x1000 from lld).
segments = subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True, check=True).stdout
code_segment = next(line.split() for line in segments.splitlines() if line.split()[:1] == ["LOAD"] and "E" in line.split()[6:-1])
vaddr_above_offset = int(code_segment[2], 16) - int(code_segment[1], 16)
sample = re.compile(r"^\s*(\d+)(?:/\d+)?\s+([0-9a-f]+)\s+(.*?)\s*\((.*)\)\s*$")
code_base = {}  # pid -> what to subtract from an address in the code to get its virtual address
own = collections.defaultdict(collections.Counter)  # pid -> address in the binary -> samples
named = collections.defaultdict(collections.Counter)  # pid -> name -> samples
totals = collections.Counter()
for line in script.splitlines():
    if "PERF_RECORD_" in line:
        m = code_mapping.search(line)
        if m:
            code_base[int(m.group(1))] = int(m.group(2), 16) - int(m.group(3), 16) - vaddr_above_offset
        continue
    m = sample.match(line)
    if not m:
        continue
    pid, ip, sym, dso = int(m.group(1)), int(m.group(2), 16), m.group(3), m.group(4)
    totals[pid] += 1
    if dso == binary and pid in code_base:
        own[pid][ip - code_base[pid]] += 1
    else:
        named[pid][sym if sym and sym != "[unknown]" else f"({dso})"] += 1

for pid, count in totals.most_common(processes):
    addresses = sorted(own[pid])
    names = subprocess.run(["addr2line", "-C", "-f", "-e", binary] + [hex(a) for a in addresses], capture_output=True, text=True, check=True).stdout.splitlines()[0::2]
    functions = named[pid].copy()
    for address, name in zip(addresses, names):
        functions[name] += own[pid][address]
    print(f"== pid {pid}: {count} samples")
    for name, n in functions.most_common(top):
        print(f"{100 * n / count:6.2f}%  {name[:160]}")
