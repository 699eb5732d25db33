// The session stream over WebSocket: one binary message per SessionRequest / SessionResponse. Works with a
// browser's WebSocket or any implementation of its API (Node 20: the ``ws`` package).

export const SUBPROTOCOL = "tandem.v1";

/** The stream ended: ``code`` 1000 after Closed, 4000 + a gRPC status code when the verifier or the gateway
 * refused something (``grpcCode``), with its message as ``reason``. */
export class SessionEnded extends Error {
  constructor(readonly code: number, readonly reason: string) {
    super(code >= 4000 ? `session refused (gRPC status ${code - 4000}): ${reason}` : `session ended (${code}) ${reason}`);
  }

  get grpcCode(): number | null {
    return this.code >= 4000 && this.code < 4100 ? this.code - 4000 : null;
  }
}

export interface Transport {
  send(message: Uint8Array): void;
  receive(): Promise<Uint8Array>;
  close(): void;
}

type WebSocketClass = new (url: string, protocols: string[]) => WebSocket;

/** Open a session stream at ``url`` (``wss://host/v1/edge/session``) with an edge token or API key. */
export function connect(url: string, credential: string, WebSocketImpl?: WebSocketClass): Promise<Transport> {
  const Impl = WebSocketImpl ?? (globalThis.WebSocket as unknown as WebSocketClass);
  const ws = new Impl(url, [SUBPROTOCOL, `bearer.${credential}`]);
  ws.binaryType = "arraybuffer";
  const inbox: Uint8Array[] = [];
  const waiting: { resolve: (m: Uint8Array) => void; reject: (e: Error) => void }[] = [];
  let ended: SessionEnded | null = null;
  ws.onmessage = (event) => {
    const message = new Uint8Array(event.data as ArrayBuffer);
    const next = waiting.shift();
    if (next) next.resolve(message);
    else inbox.push(message);
  };
  return new Promise((resolve, reject) => {
    ws.onopen = () => resolve({
      send: (message) => ws.send(message),
      receive: () => {
        const message = inbox.shift();
        if (message) return Promise.resolve(message);
        if (ended) return Promise.reject(ended);
        return new Promise((res, rej) => waiting.push({ resolve: res, reject: rej }));
      },
      close: () => ws.close(1000),
    });
    ws.onclose = (event) => {
      ended = new SessionEnded(event.code, event.reason);
      reject(ended);  // (no effect once open)
      for (const w of waiting.splice(0)) w.reject(ended);
    };
  });
}
