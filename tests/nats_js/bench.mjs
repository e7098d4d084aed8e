// One side of a `bench nats-clients --client nats.js` scenario (bench/nats_js.py):
//   node bench.mjs ROLE HOST PORT COUNT SIZE CONCURRENCY
// ROLE is receive, send, respond or request, what bench/client.py's nats.py workers do
// with nats.py. Prints "ready" once it can take traffic, then "done JSON" with its
// figures and exits 0; on an error prints it on stderr and exits 1. A responder serves
// until its stdin ends (the bench closes it once the requester is done).
import { connect } from "nats";

const SUBJECT = "bench.client"; // bench/client.py's subject
// Bounds one scenario, as bench/client.py's _SCENARIO_TIMEOUT does: reached only when
// messages were lost or a peer hung.
const SCENARIO_TIMEOUT_MS = 120_000;

const [role, host, port, count, size, concurrency] = process.argv.slice(2);
const total = Number(count);
const payload = new Uint8Array(Number(size)).fill(0x78); // b"x" * size
const warmup = Math.max(1, Math.floor(total / 10));

const ready = () => process.stdout.write("ready\n");

// Arrivals from the end of the warm-up (a tenth of them) to the last one: msgs/s.
function arrivals(n) {
  let seen = 0;
  let started = 0;
  let finish;
  const ended = new Promise((resolve) => { finish = resolve; });
  return {
    arrived() {
      seen += 1;
      if (seen === warmup) started = performance.now();
      if (seen === n) finish({ msgs_per_s: (n - warmup) / ((performance.now() - started) / 1000) });
    },
    ended,
  };
}

function stdinEnded() {
  return new Promise((resolve) => {
    process.stdin.on("end", resolve);
    process.stdin.resume();
  });
}

const roles = {
  async receive(nc) {
    const counted = arrivals(total);
    nc.subscribe(SUBJECT, { callback: () => counted.arrived() });
    await nc.flush();
    ready();
    return counted.ended;
  },
  async send(nc) {
    ready();
    // As nats.js's own bench publishes: the loop fills its outbound buffer, written to
    // the socket every 32 KiB.
    for (let i = 0; i < total; i++) nc.publish(SUBJECT, payload);
    await nc.flush();
    return {};
  },
  async respond(nc) {
    nc.subscribe(SUBJECT, { callback: (_, m) => m.respond(m.data) });
    await nc.flush();
    ready();
    await stdinEnded();
    return {};
  },
  async request(nc) {
    const latencies = [];
    let left = total + warmup;
    let started = 0;
    async function requester() {
      while (left > 0) {
        left -= 1;
        const sent = performance.now();
        await nc.request(SUBJECT, payload, { timeout: 30_000 });
        const done = performance.now();
        if (left < total) latencies.push(done - sent);
        else if (!started) started = done; // the warm-up ends with this response
      }
    }
    ready();
    await Promise.all(Array.from({ length: Number(concurrency) }, requester));
    const elapsed = (performance.now() - started) / 1000;
    latencies.sort((a, b) => a - b);
    const middle = latencies.length >> 1;
    const p50 = latencies.length % 2
      ? latencies[middle]
      : (latencies[middle - 1] + latencies[middle]) / 2;
    return { requests_per_s: latencies.length / elapsed, p50_us: p50 * 1000 };
  },
};

const timer = setTimeout(() => {
  process.stderr.write(`${role}: not done in ${SCENARIO_TIMEOUT_MS / 1000} s\n`);
  process.exit(1);
}, SCENARIO_TIMEOUT_MS);
try {
  const nc = await connect({ servers: `${host}:${port}`, timeout: 5000 });
  const figures = await roles[role](nc);
  await nc.close();
  process.stdout.write(`done ${JSON.stringify(figures)}\n`);
  clearTimeout(timer);
} catch (err) {
  process.stderr.write(`${role}: ${err.stack ?? err}\n`);
  process.exit(1);
}
