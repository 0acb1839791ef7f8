"""A TLS front for the mock upstream, for tests of turnguard in front of an ``https://``
upstream: it terminates TLS (a throwaway self-signed certificate for ``localhost`` and
127.0.0.1, made by ``make_cert``) and passes the plaintext both ways to a plain HTTP server.
It logs each connection's SNI and ALPN, so a test sees how the proxy reached it.

    python tests/tls_front.py --target PORT --cert C.pem --key K.pem --log F.jsonl

prints ``tls front listening at https://127.0.0.1:PORT`` once it listens; SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import signal
import ssl
from pathlib import Path

LINE = r"tls front listening at (https://127\.0\.0\.1:(\d+))"


def make_cert(directory: Path, name: str = "front") -> tuple[Path, Path]:
    """A self-signed certificate (its own CA: it can be the trusted CA) for ``localhost`` and
    127.0.0.1, and its key: (cert.pem, key.pem) in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"turnguard test {name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, OSError):
            pass


async def _serve_h2(reader, writer, target: int, log, max_streams: int | None = None) -> None:
    """HTTP/2 to the client; each stream becomes an HTTP/1.1 request to the target, whose
    response body goes back as it comes. ``max_streams``: the MAX_CONCURRENT_STREAMS it
    announces in its first SETTINGS (h2's default when None)."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings
    import httpx

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    if max_streams is not None:
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    streams: dict[int, dict] = {}
    answering: dict[int, asyncio.Task] = {}
    lock = asyncio.Lock()
    client = httpx.AsyncClient(trust_env=False, timeout=60)

    async def flush() -> None:
        async with lock:
            writer.write(conn.data_to_send())
            await writer.drain()

    async def answer(sid: int, headers: dict, body: bytes) -> None:
        fwd = {k: v for k, v in headers.items() if not k.startswith(":")}
        fwd["host"] = headers.get(":authority", "localhost")
        log.write(json.dumps({"event": "h2_request", "path": headers.get(":path")}) + "\n")
        try:
            async with client.stream(headers[":method"], f"http://127.0.0.1:{target}"
                                     f"{headers[':path']}", headers=fwd, content=body) as r:
                out = [(":status", str(r.status_code))] + [
                    (k.lower(), v) for k, v in r.headers.items()
                    if k.lower() not in ("connection", "transfer-encoding", "keep-alive")]
                conn.send_headers(sid, out)
                await flush()
                async for chunk in r.aiter_raw():
                    while chunk:  # within the flow-control window and frame size
                        n = min(len(chunk), conn.local_flow_control_window(sid),
                                conn.max_outbound_frame_size)
                        if n <= 0:
                            await asyncio.sleep(0.01)
                            continue
                        conn.send_data(sid, chunk[:n])
                        chunk = chunk[n:]
                        await flush()
                conn.end_stream(sid)
                await flush()
        except Exception:  # noqa: BLE001 - the upstream cut: reset the stream
            try:
                conn.reset_stream(sid)
                await flush()
            except Exception:  # noqa: BLE001
                pass

    try:
        while data := await reader.read(65536):
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    streams[ev.stream_id] = {"headers": {
                        (k.decode() if isinstance(k, bytes) else k):
                        (v.decode() if isinstance(v, bytes) else v) for k, v in ev.headers},
                        "body": b""}
                elif isinstance(ev, h2.events.DataReceived):
                    streams[ev.stream_id]["body"] += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                if isinstance(ev, h2.events.StreamEnded) or (
                        isinstance(ev, h2.events.RequestReceived) and ev.stream_ended):
                    st = streams.pop(ev.stream_id)
                    answering[ev.stream_id] = asyncio.ensure_future(
                        answer(ev.stream_id, st["headers"], st["body"]))
                elif isinstance(ev, h2.events.StreamReset):  # the client gave the stream up:
                    # so does its request to the target (it sees its client leave)
                    log.write(json.dumps({"event": "h2_reset", "stream": ev.stream_id,
                                          "code": int(ev.error_code)}) + "\n")
                    task = answering.pop(ev.stream_id, None)
                    if task is not None:
                        task.cancel()
            await flush()
    except (ConnectionError, OSError):
        pass
    finally:  # the connection ended: its streams' requests to the target end with it
        for task in answering.values():
            task.cancel()
        writer.close()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", type=int, required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--h2", action="store_true",
                   help="speak HTTP/2 (ALPN h2 only), each stream a request to the target")
    p.add_argument("--max-streams", type=int, default=None,
                   help="with --h2: the MAX_CONCURRENT_STREAMS it announces")
    a = p.parse_args()
    sni: dict[int, str | None] = {}
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(a.cert, a.key)
    ctx.set_alpn_protocols(["h2"] if a.h2 else ["http/1.1"])
    ctx.sni_callback = lambda sock, name, _ctx: sni.__setitem__(id(sock), name)
    log = open(a.log, "a", buffering=1)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        obj = writer.get_extra_info("ssl_object")
        log.write(json.dumps({"event": "connection", "sni": sni.pop(id(obj), None),
                              "alpn": obj.selected_alpn_protocol()}) + "\n")
        if a.h2:
            await _serve_h2(reader, writer, a.target, log, a.max_streams)
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", a.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    print(f"tls front listening at https://127.0.0.1:{server.sockets[0].getsockname()[1]}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
