"""A minimal OTLP/HTTP trace receiver for the trace-cost benchmark: it reads each export and
answers 200 with an empty ExportTraceServiceResponse, storing nothing, so that the proxy's cost
of tracing can be told apart from a collector's own CPU on the same 2 cores.
Run: python -m bench.otlp_sink PORT
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
