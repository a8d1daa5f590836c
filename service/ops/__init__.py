"""Operations: health, metrics, request logs, tracing, the watchdog, reflection."""
