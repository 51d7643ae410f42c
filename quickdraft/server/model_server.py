"""What every dialect's routes share: the served model, its engine queue, metrics, grammars."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quickdraft.server.errors import ApiError
from quickdraft.server.grammar import GrammarCompiler
from quickdraft.server.metrics import ServerMetrics
from quickdraft.server.tools import ToolFormat
from quickdraft.server.worker import EngineWorker

if TYPE_CHECKING:
    from quickdraft.api import LLM


@dataclass
class ModelServer:
    """The model, its queue, metrics and grammar compiler, as the routes use them."""

    llm: LLM
    names: tuple[str, ...]  # the served names (aliases); the first is reported in responses
    worker: EngineWorker
    metrics: ServerMetrics
    grammar: GrammarCompiler
    tool_format: ToolFormat | None = None  # how this model writes tool calls; None = it cannot
    tool_parser: str = "auto"
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.llm.engine.cache.max_len

    @property
    def name(self) -> str:
        return self.names[0]

    def check_model(self, model: str) -> None:
        if model not in self.names:
            served = ", ".join(f"`{n}`" for n in self.names)
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )
