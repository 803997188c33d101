"""A service whose teardown starts a call in the loop's default executor that outlasts the stop grace (as a training
pool's close or a checkpoint cut at the grace does): `python -m tests.integration.lingering_thread_service --config
C --nats URL`. The call, if it ever ends, writes the file named by LINGER_MARK."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from shared.kernel.service import Service, main_for


def _linger() -> None:
    time.sleep(float(os.environ.get("LINGER_S", "600")))
    Path(os.environ["LINGER_MARK"]).write_text("the call ended")


class Lingering(Service):
    name = "lingering"

    async def setup(self) -> None:
        Path(os.environ["LINGER_MARK"] + ".ready").write_text("ready")

    async def teardown(self) -> None:
        await asyncio.to_thread(_linger)


if __name__ == "__main__":
    main_for(Lingering)
