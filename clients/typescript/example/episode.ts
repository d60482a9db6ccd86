// One FrozenLake episode through envserve's generated TypeScript client.
// ENVSERVE_ADDRESS: host:port of a replica; ENVSERVE_TOKEN: its bearer token, where it has tokens.
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { EnvService, StateService } from "../gen/envserve/v1/envserve_pb.js";

const address = process.env.ENVSERVE_ADDRESS ?? "127.0.0.1:50051";
const token = process.env.ENVSERVE_TOKEN;

// Every call carries the token as `authorization: Bearer <token>` metadata.
const bearer: Interceptor = (next) => (req) => {
  if (token) req.header.set("authorization", `Bearer ${token}`);
  return next(req);
};
// A replica serving TLS: https://host:port, and the CA as the third argument
// (new Http2SessionManager(url, undefined, { ca: readFileSync("ca.pem") })).
const url = `http://${address}`;
const connection = new Http2SessionManager(url);
const transport = createGrpcTransport({ baseUrl: url, sessionManager: connection, interceptors: [bearer] });
const env = createClient(EnvService, transport);
const state = createClient(StateService, transport);

// FrozenLake's ground truth: [row, column] cells, rows counted from the top.
interface Truth {
  player: [number, number];
  goal: [number, number];
  holes: [number, number][];
}

// Stands in for the model: one step toward the goal, around a hole where it can.
function policy(t: Truth): string {
  const [r, c] = t.player;
  const hole = (cell: [number, number]) => t.holes.some(([hr, hc]) => hr === cell[0] && hc === cell[1]);
  const down = r < t.goal[0] && !hole([r + 1, c]);
  const right = c < t.goal[1] && !hole([r, c + 1]);
  const move = down ? "Down" : right ? "Right" : r < t.goal[0] ? "Right" : "Down";
  return `<think>the goal is at ${t.goal}</think><answer>${move}</answer>`;
}

try {
  // Config overrides as a JSON object; an unknown key is INVALID_ARGUMENT naming it.
  const opened = await env.open({
    envId: "frozenlake",
    count: 1,
    configJson: JSON.stringify({ size: 4, max_turns: 10, max_actions_per_turn: 1 }),
  });
  const sessionId = opened.sessionIds[0];
  const first = await env.reset({ items: [{ sessionId, seed: 7n }] });
  console.log(first.results[0].observation?.text);

  for (let done = false; !done; ) {
    // No turn: the latest. state_json is plain JSON, integers included.
    const truth: Truth = JSON.parse((await state.readState({ sessionId })).stateJson);
    const [result] = (await env.step({ items: [{ sessionId, action: policy(truth) }] })).results;
    // Each item has its own status (a gRPC code; 0 is OK): a lost session fails alone.
    if (result.status?.code !== 0) throw new Error(`step: ${result.status?.code} ${result.status?.message}`);
    if (!result.actionValid) console.log(`invalid action: ${result.feedback}`);
    console.log(`turn ${result.turn}: ${result.parsedActions.join(", ")} reward ${result.reward}`);
    done = result.done || result.truncated;
    if (done) console.log(result.success ? "done: reached the goal" : "done: the episode ended");
  }

  const closed = await env.closeSessions({ sessionIds: [sessionId] });
  console.log(`closed: ${closed.statuses[0].code === 0 ? "OK" : closed.statuses[0].message}`);
} catch (err) {
  const e = ConnectError.from(err);
  console.error(`${Code[e.code]}: ${e.rawMessage}`);
  process.exitCode = 1;
} finally {
  connection.abort();
}
