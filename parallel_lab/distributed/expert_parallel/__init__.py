"""Expert parallelism: experts spread over ranks, tokens dispatched and combined with all-to-all."""
