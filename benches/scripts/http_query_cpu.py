#!/usr/bin/env python3
"""Server CPU per Dynamo-compatible `POST /query` (1,024 token ids), one keep-alive connection.

Starts `KVATLAS serve` on loopback ports it picks, registers one worker (its endpoint need not
answer, so the index stays empty: the figure is the request's parse, hashing and a short
answer), sends N queries after 500 warm-up ones and prints the server's CPU time (user + system,
from /proc) per query. Compare binaries by running them alternately:

    python3 benches/scripts/http_query_cpu.py target/release/kvatlas 20000
"""
import http.client
import json
import os
import re
import subprocess
import sys
import time


def main() -> None:
    binary, n = sys.argv[1], int(sys.argv[2])
    server = subprocess.Popen(
        [binary, "serve", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
         "--log", "warn,kvatlas_server::server=info"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in server.stderr:
            found = re.search(r"HTTP on ([0-9.:]+)", line)
            if found:
                address = found.group(1)
                break
        if address is None:
            sys.exit("the server did not report its HTTP address")
        host, port = address.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port))
        headers = {"Content-Type": "application/json"}

        def post(path: str, body: bytes) -> int:
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            response.read()
            return response.status

        register = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m",
                    "block_size": 16}
        status = post("/register", json.dumps(register).encode())
        if status >= 300:
            sys.exit(f"/register answered {status}")
        query = json.dumps({"model_name": "m", "token_ids": list(range(1000, 2024))}).encode()

        def cpu_seconds() -> float:
            fields = open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        for _ in range(500):
            if post("/query", query) != 200:
                sys.exit("/query failed")
        start, cpu_start = time.time(), cpu_seconds()
        for _ in range(n):
            post("/query", query)
        elapsed, cpu = time.time() - start, cpu_seconds() - cpu_start
        print(f"{binary}: {n} queries, server CPU {1e6 * cpu / n:.1f} µs/query, "
              f"{n / elapsed:.0f} queries/s on one connection")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
