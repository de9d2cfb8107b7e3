"""Resumable image upload: ask the payload what it holds (IMAGE_QUERY), send only the missing
chunks with a window of acknowledgements in flight, and when answers stop, ask again and resume,
so that an upload survives link loss, a bus restart or a payload power cut without sending a
held chunk twice."""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from common.wire import RequestRef, ResponseCode
from common.wire import messages as m
from common.wire.ids import MAX_CHUNK_DATA_BYTES
from ground.client.session import RESYNC_CODES, CommandSession, after
from ground.errors import CommandRejected, NoAnswer
from ground.images import PreparedImage


@dataclass
class ImageUpload:
    """What happened to one image during an uplink."""

    path: str
    name: str
    size: int
    sha256: str
    chunks: int
    #: chunks the payload already held when the uplink started (not sent)
    held_before: int = 0
    #: IMAGE_CHUNK packets sent (a chunk lost with the link is sent again and counted again)
    chunks_sent: int = 0
    queries: int = 0
    #: rounds that stopped hearing back and resumed with IMAGE_QUERY
    resumes: int = 0
    verified: bool = False


class _Progress:
    """One image's upload as the operator follows it: the tqdm bar (on a terminal) and the
    session's `upload_progress(name, bytes on board, size)` (the console's page), counted here
    (a disabled tqdm bar counts nothing)."""

    def __init__(self, bar: tqdm, image: PreparedImage, report: Callable[[str, int, int], None] | None):
        self.bar, self.image, self.report = bar, image, report
        self.n = 0

    def update(self, nbytes: int) -> None:
        self.bar.update(nbytes)
        self.set(self.n + nbytes, bar=False)

    def set(self, nbytes: int, bar: bool = True) -> None:
        self.n = nbytes
        if bar:
            self.bar.n = nbytes
            self.bar.refresh()
        if self.report is not None:
            self.report(self.image.name, self.n, self.image.size)

    def close(self) -> None:
        self.bar.close()


class ImageUploader:
    """IMAGE_QUERY and IMAGE_CHUNK, resumed across silences, over a session's link."""

    def __init__(self, session: CommandSession):
        self.session = session

    def query_image(self, name: str) -> m.ImageStatus:
        _, status = self.session.transact(
            m.ImageQuery(image=name),
            f"IMAGE_QUERY {name}",
            reply=lambda mark: after(self.session.arrivals.image_status.get(name), mark),
        )
        return status

    def upload_image(self, image: PreparedImage) -> ImageUpload:
        """Send the chunks of `image` the payload does not hold, until it reports the file
        verified. Resumes by re-querying whenever answers stop for `timeout_s`."""
        chunks = image.chunks(self.session.chunk_bytes)
        stats = ImageUpload(
            path=image.path, name=image.name, size=image.size, sha256=image.sha256.hex(), chunks=len(chunks)
        )
        bar = _Progress(self._progress_bar(image), image, self.session.upload_progress)
        stalls = 0
        first_answer = True
        try:
            while True:
                try:
                    status = self.query_image(image.name)
                    stats.queries += 1
                except NoAnswer as exc:
                    stalls += 1
                    stats.resumes += 1
                    self._give_up_after(stalls, exc, image)
                    self.session.notify(f"{exc}; asking again ({stalls}/{self.session.retries})")
                    continue
                if status.verified:
                    if status.image_size != image.size:
                        raise CommandRejected(
                            f"image {image.name}",
                            ResponseCode.CHUNK_CONFLICT,
                            f"the payload holds a verified {status.image_size}-byte file under this name, "
                            f"ours has {image.size}",
                        )
                    if first_answer:
                        stats.held_before = len(chunks)
                    bar.update(image.size - bar.n)
                    stats.verified = True
                    return stats
                if status.total and status.total != len(chunks):
                    chunks = self._adopt_chunking(image, status, chunks)
                    stats.chunks = len(chunks)
                missing = status.missing() if status.total else list(range(len(chunks)))
                missing_set = set(missing)
                held = [c for c in chunks if c.index not in missing_set]
                if first_answer:
                    stats.held_before = len(held)
                    first_answer = False
                    if held:
                        self.session.notify(
                            f"image {image.name}: payload already holds {len(held)}/{len(chunks)} chunks; "
                            f"sending {len(missing)}"
                        )
                bar.set(sum(len(c.data) for c in held))
                if not missing:
                    # Every chunk held but not verified yet: the payload is still checking the file.
                    stalls += 1
                    self._give_up_after(
                        stalls,
                        NoAnswer(f"image {image.name}: payload holds every chunk but does not report it verified"),
                        image,
                    )
                    self.session.pump(min(self.session.timeout_s, 1.0))
                    continue
                try:
                    acked, finished = self._send_chunks(image, chunks, missing, bar, stats)
                except NoAnswer:
                    acked, finished = 0, False  # the link would not take a chunk: same as no answer
                if finished:
                    stalls = 0
                    continue
                # Acknowledgements stopped: ask what the payload holds now and send only that.
                stalls = 0 if acked else stalls + 1
                stats.resumes += 1
                silence = NoAnswer(self.session.silence(f"image {image.name}", self.session.timeout_s))
                self._give_up_after(stalls, silence, image)
                count = f" ({stalls}/{self.session.retries} unanswered rounds)" if stalls else ""
                self.session.notify(f"{silence}; re-querying to resume{count}")
        finally:
            bar.close()

    def _give_up_after(self, stalls: int, exc: NoAnswer, image: PreparedImage) -> None:
        if stalls > self.session.retries:
            raise NoAnswer(
                f"{exc}; gave up after {stalls} unanswered rounds. Chunks already delivered stay on board: "
                "run the same uplink again to resume"
            ) from None

    def _adopt_chunking(
        self, image: PreparedImage, status: m.ImageStatus, chunks: list[m.ImageChunk]
    ) -> list[m.ImageChunk]:
        """The payload holds part of this image cut into another number of chunks (an earlier
        uplink with another --chunk-bytes). Cut ours the same way, so that the held chunks count
        and none conflicts: with the chunk size this station recorded for the image, else with
        the one power-of-two size (or the maximum) that gives that many chunks. If none fits,
        the payload would refuse our chunks: say so, with the fix."""

        def fits(size: int) -> bool:
            return 1 <= size <= MAX_CHUNK_DATA_BYTES and math.ceil(image.size / size) == status.total

        recorded = [t.get("chunk_bytes") for t in self.session.state.tasks() if image.name in t.get("images", [])]
        candidates = [c for c in recorded if isinstance(c, int) and fits(c)]
        if not candidates:
            candidates = [c for c in [1 << k for k in range(9, 16)] + [MAX_CHUNK_DATA_BYTES] if fits(c)]
        if status.image_size != image.size or not candidates:
            raise CommandRejected(
                f"image {image.name}",
                ResponseCode.CHUNK_CONFLICT,
                f"the payload holds part of this image cut into {status.total} chunks by an earlier upload with "
                "another chunk size; run the uplink with the --chunk-bytes used then",
            )
        size = candidates[0]
        self.session.notify(
            f"image {image.name}: payload holds it in {status.total} chunks; using {size}-byte chunks to match"
        )
        return image.chunks(size)

    def _send_chunks(
        self, image: PreparedImage, chunks: list[m.ImageChunk], missing: list[int], bar: _Progress, stats: ImageUpload
    ) -> tuple[int, bool]:
        """Send `missing` with at most `window` unacknowledged. Returns (acknowledged, finished):
        it stops early, unfinished, when no acknowledgement arrives for `timeout_s`."""
        started, sent_before = time.time(), stats.chunks_sent
        outcome, text = "OK", ""
        try:
            acked, finished = self._send_chunk_round(image, chunks, missing, bar, stats)
            if not finished:
                outcome, text = "NO_ANSWER", "acknowledgements stopped; the upload resumes with IMAGE_QUERY"
            return acked, finished
        except CommandRejected as exc:
            outcome, text = exc.code.name, exc.reason
            raise
        except BaseException as exc:
            outcome, text = type(exc).__name__, str(exc)
            raise
        finally:
            # one line per round in the command log, not one per chunk (thousands for one image)
            what = f"image {image.name}"
            self.session.log_command(
                "IMAGE_CHUNK", what, started, None, outcome, text, chunks=stats.chunks_sent - sent_before
            )

    def _send_chunk_round(
        self, image: PreparedImage, chunks: list[m.ImageChunk], missing: list[int], bar: _Progress, stats: ImageUpload
    ) -> tuple[int, bool]:
        queue = deque(missing)
        inflight: dict[RequestRef, m.ImageChunk] = {}
        acked = resyncs = 0
        last_progress = time.monotonic()
        while queue or inflight:
            while queue and len(inflight) < self.session.window:
                chunk = chunks[queue.popleft()]
                inflight[self.session.send(chunk)] = chunk
                stats.chunks_sent += 1
            self.session.pump(0.2)
            for ref, chunk in list(inflight.items()):
                verdict = self.session.verdict([ref], m.Accepted)
                if verdict is None:
                    continue
                del inflight[ref]
                last_progress = time.monotonic()
                if not isinstance(verdict, (m.Rejected, m.Failed)):  # the ACCEPTED asked for
                    acked += 1
                    bar.update(len(chunk.data))
                elif (
                    isinstance(verdict, m.Rejected)
                    and verdict.code in RESYNC_CODES
                    and verdict.highest_seq is not None
                    and resyncs < 3
                ):
                    resyncs += 1
                    self.session.resync(verdict)
                    queue.appendleft(chunk.index)
                else:
                    raise self.session.rejection(f"image {image.name} ({image.path}) chunk {chunk.index}", verdict)
            if inflight and time.monotonic() - last_progress > self.session.timeout_s:
                return acked, False
        return acked, True

    def _progress_bar(self, image: PreparedImage) -> tqdm:
        return tqdm(
            total=image.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=image.name,
            file=sys.stderr,
            disable=None if self.session.progress is None else not self.session.progress,
            leave=True,
            dynamic_ncols=True,
        )
