"""Batch inference: `raymuter batch INPUT OUTPUT`, a file of requests through the server's own
routes in engine actors on Ray Data, as OpenAI's batch file format says.

    requests.py      the batch file's lines (and a table's rows) as requests, their answers as lines
    route_client.py  a line sent to the server's own routes in this process (also the server's
                     ingress, for its Records deployment: deployments/services/batches.py)
    worker.py        BatchWorker: one engine replica's worth, the HTTP routes in its own process
    run.py           the Ray Data pipeline, resuming, progress; `raymuter batch`'s arguments
"""
