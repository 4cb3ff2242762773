"""`shardwise serve`: the tensor-parallel inference engine behind an HTTP endpoint in the shape of OpenAI's
completions API.

- protocol.py: request and response models, and where a completion's text ends (pure)
- batching.py: which queued prompts generate together, and the queue into the loop (pure)
- app.py: the FastAPI app on rank 0 (checks, tokenizes, queues, answers)
- worker.py: the loop every rank runs (rank 0 batches and broadcasts, all ranks generate)
- options.py: the command's options, read alike by the command and by every rank (no torch)
- cli.py: the command line, starting the ranks through the launcher

Nothing is imported here: FastAPI and uvicorn load only when a server starts.
"""
