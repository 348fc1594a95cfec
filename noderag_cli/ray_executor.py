"""The executor for a Ray cluster (`executor: {kind: ray, address: ...}`): each batch of
per-document or per-chunk work is a Ray task on the cluster, and the graph-wide steps stay in this
process (the driver), as with local workers.

What the cluster needs: the `ray` extra and the same noderag-cli version on every node (the tasks
import it), and for an LLM engine its key variable in the nodes' environment (it is never sent).
A task whose worker dies is run again by Ray (`MAX_RETRIES`); results are taken in the batches'
order, so the tables are the same as a local build's. Ray is imported only here, and only when a
config asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .config import ConfigError, ExecutorConfig

MAX_RETRIES = 3  # runs of a task whose worker died, before the run fails


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("executor.kind is ray, but Ray is not installed: pip install 'noderag-cli[ray]'") from None
    return ray


class RayExecutor:
    """Runs a function over batches as Ray tasks on an existing cluster."""

    def __init__(self, config: ExecutorConfig):
        ray = _ray()
        self.address = config.address or "auto"
        try:
            if not ray.is_initialized():
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ConfigError(f"cannot join the Ray cluster at {self.address}: {str(err).splitlines()[0][:200]} "
                              "(start one with `ray start --head`, or set executor.address)") from None
        self._remote: dict[Callable, Any] = {}

    def __repr__(self) -> str:
        return f"Ray cluster at {self.address}"

    @property
    def workers(self) -> int:
        return int(_ray().cluster_resources().get("CPU", 1))

    def map(self, function: Callable[[Any], Any], batches: Sequence[Any],
            done: Callable[[Any, Any], None] | None = None) -> list:
        """function(batch) for every batch as a Ray task, results in the batches' order; `done(batch,
        result)` is called here as each result is taken, in that order too."""
        ray = _ray()
        if function not in self._remote:
            self._remote[function] = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(function)
        remote = self._remote[function]
        pending = [remote.remote(batch) for batch in batches]
        results = []
        for batch, reference in zip(batches, pending, strict=True):
            results.append(ray.get(reference))
            if done:
                done(batch, results[-1])
        return results

    def close(self) -> None:
        """Leave the cluster (it keeps running for other drivers)."""
        _ray().shutdown()
