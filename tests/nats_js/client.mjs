// nats.js against a NATS server: node client.mjs CHECK OPTIONS_JSON
// CHECK is one of the checks below; OPTIONS_JSON is nats.js's connect options, with
// "seed" (an nkey seed, for nkeyAuthenticator) and "ca" (a CA file, for tls) as
// strings. Prints "ok CHECK" and exits 0, or prints the error and exits 1.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import {
  connect, createInbox, headers, nkeyAuthenticator, Empty, ErrorCode, StringCodec,
} from "nats";

const sc = StringCodec();
const [check, optionsText] = process.argv.slice(2);
const options = JSON.parse(optionsText);
if (options.seed) {
  options.authenticator = nkeyAuthenticator(new TextEncoder().encode(options.seed));
  delete options.seed;
}
if (options.ca) {
  options.tls = { caFile: options.ca };
  delete options.ca;
}
options.timeout = 5000;

// The messages of a subscription, until ``count`` came (or 5 s passed).
async function take(sub, count) {
  const got = [];
  const timer = setTimeout(() => sub.unsubscribe(), 5000);
  for await (const m of sub) {
    got.push(m);
    if (got.length === count) break;
  }
  clearTimeout(timer);
  return got;
}

const checks = {
  // Wildcards: one copy per matching subscription.
  async wildcards(nc) {
    const star = nc.subscribe("js.wild.*");
    const gt = nc.subscribe("js.>");
    const exact = nc.subscribe("js.wild.a");
    await nc.flush();
    nc.publish("js.wild.a", sc.encode("one"));
    nc.publish("js.other.b.c", sc.encode("two"));
    assert.deepEqual((await take(star, 1)).map((m) => m.subject), ["js.wild.a"]);
    assert.deepEqual((await take(gt, 2)).map((m) => sc.decode(m.data)), ["one", "two"]);
    assert.deepEqual((await take(exact, 1)).map((m) => sc.decode(m.data)), ["one"]);
  },
  // A queue group gets each message once, spread over its members.
  async queues(nc) {
    const counts = [0, 0];
    const subs = [0, 1].map((i) =>
      nc.subscribe("js.work", { queue: "workers", callback: () => { counts[i] += 1; } }));
    await nc.flush();
    for (let i = 0; i < 200; i++) nc.publish("js.work", Empty);
    await nc.flush();
    const deadline = Date.now() + 5000;
    while (counts[0] + counts[1] < 200 && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 10));
    }
    assert.equal(counts[0] + counts[1], 200);
    assert.ok(counts[0] > 0 && counts[1] > 0, `both members got some: ${counts}`);
    subs.forEach((s) => s.unsubscribe());
  },
  // Headers arrive as sent.
  async headers(nc) {
    const sub = nc.subscribe("js.headers");
    await nc.flush();
    const h = headers();
    h.set("X-Trace", "abc");
    h.append("X-Multi", "1");
    h.append("X-Multi", "2");
    nc.publish("js.headers", sc.encode("body"), { headers: h });
    const [m] = await take(sub, 1);
    assert.equal(m.headers.get("X-Trace"), "abc");
    assert.deepEqual(m.headers.values("X-Multi"), ["1", "2"]);
    assert.equal(sc.decode(m.data), "body");
  },
  // Request/reply through the client's inbox, and an explicit inbox.
  async requests(nc) {
    nc.subscribe("js.svc", { callback: (_, m) => m.respond(sc.encode("re:" + sc.decode(m.data))) });
    await nc.flush();
    const reply = await nc.request("js.svc", sc.encode("q"), { timeout: 5000 });
    assert.equal(sc.decode(reply.data), "re:q");
    const inbox = createInbox();
    const answers = nc.subscribe(inbox);
    nc.publish("js.svc", sc.encode("again"), { reply: inbox });
    assert.equal(sc.decode((await take(answers, 1))[0].data), "re:again");
  },
  // A request nobody subscribes to: 503, which nats.js raises as NoResponders.
  async noResponders(nc) {
    await assert.rejects(
      nc.request("js.nobody.home", Empty, { timeout: 5000 }),
      (err) => err.code === ErrorCode.NoResponders,
    );
  },
  // Signed in (the options carry the credentials): a round trip.
  async signedIn(nc) {
    const sub = nc.subscribe("js.signed");
    await nc.flush();
    nc.publish("js.signed", sc.encode("in"));
    assert.equal(sc.decode((await take(sub, 1))[0].data), "in");
  },
  // Over TLS: the connection says so, and a round trip.
  async tls(nc) {
    assert.equal(nc.info.tls_required, true);
    await checks.signedIn(nc);
  },
};

let nc;
try {
  if (check === "refused") {
    await assert.rejects(connect(options), (err) => err.code === ErrorCode.AuthorizationViolation);
  } else {
    nc = await connect(options);
    await checks[check](nc);
    await nc.drain();
  }
  console.log(`ok ${check}`);
} catch (err) {
  console.log(`failed ${check}: ${err && err.stack ? err.stack : err}`);
  if (nc) await nc.close();
  process.exit(1);
}
