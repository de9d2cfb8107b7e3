"""A file layer that simulates a power cut the way SQLite's crash tests do.

Every operation goes through to a real directory (so the engine runs normally), while a shadow
model tracks what is *durable*: file contents as of their last fsync, directory entries as of the
directory's last fsync. `crash(rng)` then rewrites the directory into one state the disk could
really hold after a cut at this instant: directory changes since the last directory fsync are
kept only up to a random point, and file data written since the last fsync is dropped, kept,
torn (a random prefix survives) or left as zeros.
"""

from __future__ import annotations

import os

from common.durable import DurableFS
from flight.engine import SimulatedCut


class _Inode:
    def __init__(self, durable=b"", current=b""):
        self.durable = durable
        self.current = current


class CrashFS(DurableFS):
    def __init__(self, root: str, cut_at_step: int | None = None):
        self.root = os.path.abspath(root)
        self.cut_at_step = cut_at_step
        self.steps = 0
        self.inodes: dict[int, _Inode] = {}
        self.current: dict[str, int] = {}  # path -> inode, as the running process sees it
        self.durable: dict[str, int] = {}  # path -> inode, as the disk has it
        self.pending_dir_ops: list[tuple] = []
        self.dirs_current: set[str] = set()
        self.dirs_durable: set[str] = set()
        self._next = 0

    # -- shadow bookkeeping ---------------------------------------------------------------------
    def _new_inode(self, content=b"") -> int:
        self._next += 1
        self.inodes[self._next] = _Inode(b"", content)
        return self._next

    def _dir_op(self, op):
        self.pending_dir_ops.append(op)

    def _step(self):
        """Each primitive (write, fsync, rename, dir fsync) is a point where the power may go."""
        self.steps += 1
        if self.cut_at_step is not None and self.steps == self.cut_at_step:
            raise SimulatedCut(f"power cut at file-system step {self.steps}")

    # -- DurableFS API ----------------------------------------------------------------------------
    def write_atomic(self, path, chunks):
        data = b"".join(bytes(c) for c in chunks)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}.tmp")
        ino = self._new_inode(data)  # write(tmp): data in the page cache only
        self.current[tmp] = ino
        self._dir_op(("link", tmp, ino))
        with open(tmp, "wb") as f:
            f.write(data)
        self._step()
        self.inodes[ino].durable = data  # fsync(tmp)
        self._step()
        os.replace(tmp, path)  # rename: a directory change, not yet durable
        self.current.pop(tmp)
        self.current[path] = ino
        self._dir_op(("rename", tmp, path))
        self._step()
        self.fsync_dir(directory)
        self._step()
        return len(data)

    def append(self, path, chunks):
        data = b"".join(bytes(c) for c in chunks)
        created = path not in self.current
        if created:
            ino = self._new_inode(b"")
            self.current[path] = ino
            self._dir_op(("link", path, ino))
        node = self.inodes[self.current[path]]
        node.current += data
        with open(path, "ab") as f:
            f.write(data)
        self._step()
        node.durable = node.current  # fsync(file)
        self._step()
        if created:
            self.fsync_dir(os.path.dirname(path))
            self._step()
        return len(data)

    def truncate(self, path, size):
        node = self.inodes[self.current[path]]
        node.current = node.current[:size]
        os.truncate(path, size)
        self._step()
        node.durable = node.current
        self._step()

    def remove(self, path, sync=True):
        if path not in self.current:
            return
        self.current.pop(path)
        self._dir_op(("unlink", path))
        os.unlink(path)
        self._step()
        if sync:
            self.fsync_dir(os.path.dirname(path))
            self._step()

    def makedirs(self, path):
        if path not in self.dirs_current:
            os.makedirs(path, exist_ok=True)
            self.dirs_current.add(path)
            self.dirs_durable.add(path)  # directories are created once, before any record

    def fsync_dir(self, path):
        # Durability of directory entries: apply every pending op touching this directory.
        keep = []
        for op in self.pending_dir_ops:
            if os.path.dirname(op[1]) == os.path.abspath(path) or os.path.dirname(op[1]) == path:
                self._apply(self.durable, op)
            else:
                keep.append(op)
        self.pending_dir_ops = keep

    @staticmethod
    def _apply(table, op):
        if op[0] == "link":
            table[op[1]] = op[2]
        elif op[0] == "rename":
            if op[1] in table:
                table[op[2]] = table.pop(op[1])
        elif op[0] == "unlink":
            table.pop(op[1], None)

    # -- the cut ------------------------------------------------------------------------------------
    def crash(self, rng) -> None:
        table = dict(self.durable)
        for op in self.pending_dir_ops[: rng.integers(0, len(self.pending_dir_ops) + 1)]:
            self._apply(table, op)
        for d in sorted(self.dirs_current):
            for name in os.listdir(d):
                p = os.path.join(d, name)
                if os.path.isfile(p):
                    os.unlink(p)
        for path, ino in table.items():
            node = self.inodes[ino]
            content = node.durable
            if not node.current.startswith(node.durable):  # an un-synced truncate: old or new length
                content = node.current if rng.integers(0, 2) else node.durable
            extra = node.current[len(node.durable) :] if node.current.startswith(node.durable) else b""
            fate = rng.integers(0, 4)
            if extra and fate == 1:
                content = node.current
            elif extra and fate == 2:
                content = node.durable + extra[: rng.integers(0, len(extra) + 1)]
            elif extra and fate == 3:
                content = node.durable + bytes(int(rng.integers(0, len(extra) + 1)))
            with open(path, "wb") as f:
                f.write(content)
