#!/usr/bin/env python3
"""Writes a large PyTorch memory snapshot with stack frames, deterministically, for the
reader's benchmark and for tests of explain and the view.

    scripts/gen-snapshot.py --entries 100000 --frames 320 --gpumem target/release/gpumem out.pickle

The events are a valid trace: `gpumem simulate` (PyTorch's allocator, exactly) runs a training
loop long enough, and the last --entries events are kept, as PyTorch's ring buffer keeps its
newest. Every event and every block gets a stack of --frames frames drawn from --stacks
distinct stacks (Python and C++ frames, as `_record_memory_history(stacks="all")` records).
Each frame is its own dict (as when frames are not shared), their strings shared through the
memo, so the file is as large as such dumps get: about 31 bytes a frame.

With --fx every frame also carries the FX fields of a torch.compile graph's node
(`_snapshot(augment_with_fx_traces=True)`: `fx_node_op`, `fx_node_name`, `fx_original_trace`,
`fx_node_info`, the last None for a quarter of them), so that the reader can be measured on
such frames against the same snapshot without them.

The pickle is written in a stream, opcode by opcode as CPython's pickler writes protocol 4
(without its optional FRAME opcodes), in constant memory: `pickle.load` reads it. Python's
standard library only.
"""

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

EVENTS_PER_STEP = 590  # about what `gpumem simulate` records per training step


class Writer:
    """Protocol-4 opcodes with CPython's memo discipline: every string and container is
    memoized when first written; a string seen before is a BINGET."""

    def __init__(self, out):
        self.out = out
        self.memo = 0
        self.strings = {}
        self.chunks = []
        self.size = 0

    def write(self, b):
        self.chunks.append(b)
        self.size += len(b)
        if len(self.chunks) > 4096:
            self.flush()

    def flush(self):
        self.out.write(b"".join(self.chunks))
        self.chunks = []

    def memoize(self):
        self.memo += 1
        return b"\x94"

    def get(self, index):
        return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)

    def string(self, s):
        """The bytes of a str: a BINGET where written before."""
        index = self.strings.get(s)
        if index is not None:
            return self.get(index)
        raw = s.encode()
        head = b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))
        self.strings[s] = self.memo
        return head + raw + self.memoize()

    @staticmethod
    def int(i):
        if 0 <= i < 256:
            return b"K" + bytes([i])
        if 0 <= i < 65536:
            return b"M" + struct.pack("<H", i)
        if -(2**31) <= i < 2**31:
            return b"J" + struct.pack("<i", i)
        raw = i.to_bytes((i.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw

    def value(self, v):
        """Any plain value, written whole (containers in batches of 1000, as CPython)."""
        if v is None:
            self.write(b"N")
        elif v is True or v is False:
            self.write(b"\x88" if v else b"\x89")
        elif isinstance(v, int):
            self.write(self.int(v))
        elif isinstance(v, float):
            self.write(b"G" + struct.pack(">d", v))
        elif isinstance(v, str):
            self.write(self.string(v))
        elif isinstance(v, list):
            self.write(b"]" + self.memoize())
            for i in range(0, len(v), 1000):
                batch = v[i:i + 1000]
                if len(batch) == 1:
                    self.value(batch[0])
                    self.write(b"a")
                else:
                    self.write(b"(")
                    for item in batch:
                        self.value(item)
                    self.write(b"e")
        elif isinstance(v, dict):
            self.write(b"}" + self.memoize())
            items = list(v.items())
            for i in range(0, len(items), 1000):
                batch = items[i:i + 1000]
                if len(batch) == 1:
                    self.value(batch[0][0])
                    self.value(batch[0][1])
                    self.write(b"s")
                else:
                    self.write(b"(")
                    for k, item in batch:
                        self.value(k)
                        self.value(item)
                    self.write(b"u")
        elif isinstance(v, Frames):
            v.write(self)
        else:
            raise TypeError(type(v))


class Frames:
    """A list of frame dicts, each its own dict: a stack from the pool, written fast (a
    frame's bytes are the same every time once its strings are in the memo)."""

    def __init__(self, pool, stack):
        self.pool, self.stack = pool, stack

    def write(self, w):
        frames = self.pool.stacks[self.stack]
        w.write(b"]" + w.memoize())
        for i in range(0, len(frames), 1000):
            batch = frames[i:i + 1000]
            if len(batch) == 1:  # as CPython: APPEND for a batch of one
                w.write(self.pool.frame_bytes(w, batch[0]) + b"a")
                continue
            w.write(b"(")
            w.write(b"".join(self.pool.frame_bytes(w, f) for f in batch))
            w.write(b"e")


class Pool:
    """Distinct frames and stacks, drawn from a seeded generator."""

    def __init__(self, rng, frames_per_stack, stacks, fx=False):
        files = [f"/usr/lib/python3/site-packages/model/layer{i}.py" for i in range(60)]
        files += [f"/opt/conda/lib/python3.11/site-packages/torch/nn/modules/m{i}.py" for i in range(40)]
        files += ["??", "/usr/lib/x86_64-linux-gnu/libtorch_cuda.so", "/usr/lib/libc10.so"]
        names = [f"forward_{i}" for i in range(200)] + [f"c10::cuda::op{i}" for i in range(200)]
        self.frames = [(rng.choice(files), rng.randrange(1, 4000), rng.choice(names))
                       for _ in range(20 * frames_per_stack)]
        self.stacks = [[rng.randrange(len(self.frames)) for _ in range(frames_per_stack)]
                       for _ in range(stacks)]
        # One FX node per frame: its op, its name in the graph, the user code it was traced
        # from (long: a BINUNICODE), and its description or None.
        ops = ["call_function", "call_module", "call_method", "placeholder", "output"]
        self.fx = None
        if fx:
            self.fx = [(rng.choice(ops), f"node_{i}",
                        f"File \"/usr/lib/python3/site-packages/model/layer{i % 60}.py\", line "
                        f"{rng.randrange(1, 4000)}, in forward\n" + "    x = self.block(x)\n" * 12,
                        None if i % 4 == 0 else f"aten.op{i % 300}.default")
                       for i in range(len(self.frames))]
        self.cached = {}

    def frame_bytes(self, w, f):
        b = self.cached.get(f)
        if b is None:
            filename, line, name = self.frames[f]
            known = filename in w.strings and name in w.strings and "filename" in w.strings
            b = (b"}" + w.memoize() + b"(" + w.string("filename") + w.string(filename)
                 + w.string("line") + w.int(line) + w.string("name") + w.string(name))
            if self.fx is not None:
                op, node, trace, info = self.fx[f]
                known = known and all(s in w.strings for s in (op, node, trace, "fx_node_info"))
                b += (w.string("fx_node_op") + w.string(op) + w.string("fx_node_name")
                      + w.string(node) + w.string("fx_original_trace") + w.string(trace)
                      + w.string("fx_node_info") + (b"N" if info is None else w.string(info)))
                known = known and (info is None or info in w.strings)
            b += b"u"
            if known:
                self.cached[f] = b
            return b
        w.memo += 1  # the cached bytes hold the dict's MEMOIZE
        return b


def simulated_trace(gpumem, entries):
    """A valid snapshot from gpumem's own allocator with at least `entries` events."""
    steps = entries // EVENTS_PER_STEP + 2
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(8):
            path = os.path.join(tmp, "sim.json")
            subprocess.run([gpumem, "simulate", "--steps", str(steps), "--history", str(entries),
                            "--snapshot", path], check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                snapshot = json.load(f)
            if len(snapshot["device_traces"][0]) >= entries:
                return snapshot
            steps *= 2
    sys.exit(f"gen-snapshot: {gpumem} simulate records fewer than {entries} events")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="trace entries (100000)")
    parser.add_argument("--frames", type=int, default=320, help="frames per stack (320)")
    parser.add_argument("--stacks", type=int, default=2000, help="distinct stacks (2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fx", action="store_true", help="frames carry FX node fields")
    parser.add_argument("--gpumem", default="target/release/gpumem", help="the gpumem binary")
    parser.add_argument("out")
    args = parser.parse_args()
    if args.entries < 1 or args.frames < 0 or args.stacks < 1:
        sys.exit("gen-snapshot: --entries and --stacks must be positive, --frames not negative")
    rng = random.Random(args.seed)
    snapshot = simulated_trace(args.gpumem, args.entries)
    pool = Pool(rng, args.frames, args.stacks, args.fx)
    events = snapshot["device_traces"][0][-args.entries:]
    for e in events:
        e["frames"] = Frames(pool, rng.randrange(args.stacks))
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            block["frames"] = Frames(pool, rng.randrange(args.stacks))
    snapshot["device_traces"] = [events]
    with open(args.out, "wb") as out:
        w = Writer(out)
        w.write(b"\x80\x04")
        w.value(snapshot)
        w.write(b".")
        w.flush()
    print(f"{args.out}: {w.size} bytes, {len(events)} entries, {args.frames} frames each, "
          f"{args.stacks} distinct stacks", file=sys.stderr)


if __name__ == "__main__":
    main()
