// The plain Node path: @grpc/grpc-js with @grpc/proto-loader reading proto/envserve/v1/envserve.proto
// at run time, no generated code. ENVSERVE_ADDRESS names a replica serving sokoban and frozenlake.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const address = process.env.ENVSERVE_ADDRESS;
if (!address) throw new Error("set ENVSERVE_ADDRESS to a replica serving sokoban and frozenlake");
// The replica's bearer token, where it has tokens.
const token = process.env.ENVSERVE_TOKEN;

const PROTO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../proto");
const LOADER_OPTIONS = {
  keepCase: true, // field names as the .proto writes them: session_ids, config_json
  longs: String, // int64 (seeds) as decimal strings: a double loses seeds above 2^53
  enums: String,
  defaults: true, // unset scalars read as their zero value, unset messages as null
  oneofs: true,
  // google/protobuf/struct.proto comes with protobufjs, which proto-loader reads imports through.
  includeDirs: [PROTO_ROOT],
};

function load() {
  return protoLoader.loadSync("envserve/v1/envserve.proto", LOADER_OPTIONS);
}

const v1 = grpc.loadPackageDefinition(load()).envserve.v1;
const credentials = grpc.credentials.createInsecure();

// Sends the token as `authorization: Bearer <token>` metadata on every call. (Call credentials do
// the same but grpc-js attaches them to TLS channels only.)
const bearer = (options, nextCall) => new grpc.InterceptingCall(nextCall(options), {
  start(metadata, listener, next) {
    metadata.set("authorization", `Bearer ${token}`);
    next(metadata, listener);
  },
});
const OPTIONS = token ? { interceptors: [bearer] } : {};
let env;
let state;

// A unary call as a promise.
function call(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

const FROZENLAKE = {
  env_id: "frozenlake",
  count: 1,
  config_json: JSON.stringify({ max_turns: 20, max_actions_per_turn: 1 }),
};

before(() => {
  env = new v1.EnvService(address, credentials, OPTIONS);
  state = new v1.StateService(address, credentials, OPTIONS);
});

after(() => {
  env.close();
  state.close();
});

test("an unknown config key in config_json is INVALID_ARGUMENT naming the key", async () => {
  await assert.rejects(
    call(env, "Open", { env_id: "sokoban", count: 1, config_json: JSON.stringify({ bogus: 1 }) }),
    (err) => {
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT, err.message);
      assert.match(err.details, /bogus/);
      return true;
    },
  );
});

test("config_json that is not a JSON object is INVALID_ARGUMENT", async () => {
  await assert.rejects(
    call(env, "Open", { env_id: "sokoban", count: 1, config_json: "[6, 6]" }),
    (err) => err.code === grpc.status.INVALID_ARGUMENT,
  );
});

test("a session opened with config_json plays, and its ground truth reads as plain JSON", async () => {
  const opened = await call(env, "Open", FROZENLAKE);
  assert.equal(opened.session_ids.length, 1);
  const [sid] = opened.session_ids;
  assert.ok(opened.lease_seconds > 0);

  const reset = (await call(env, "Reset", { items: [{ session_id: sid, seed: "7" }] })).results[0];
  // Set on OK results too, so `status.code` reads without a null check.
  assert.notEqual(reset.status, null, "an OK reset result carries its status");
  assert.equal(reset.status.code, grpc.status.OK);
  assert.equal(reset.turn, 0);
  assert.equal(JSON.parse(reset.info_json).seed, 7);

  const step = (await call(env, "Step", {
    items: [{ session_id: sid, action: "<think>try</think><answer>Down</answer>" }],
  })).results[0];
  assert.equal(step.status?.code, grpc.status.OK);
  assert.equal(step.turn, 1);
  assert.ok(step.action_valid);
  assert.deepEqual(step.parsed_actions, ["Down"]);

  // No turn: the latest one.
  const latest = await call(state, "ReadState", { session_id: sid });
  assert.equal(latest.turn, 1);
  assert.equal(latest.anchor, step.anchor);
  const truth = JSON.parse(latest.state_json);
  assert.equal(truth.player.length, 2);
  assert.ok(truth.player.every(Number.isInteger), `positions are integers: ${latest.state_json}`);
  assert.ok(truth.goal.every(Number.isInteger));

  const first = await call(state, "ReadState", { session_id: sid, turn: 0 });
  assert.equal(first.turn, 0);
  assert.equal(first.anchor, reset.anchor);

  // The deprecated GetState still answers; its turn has no presence, so -1 asks for the latest.
  const old = await call(state, "GetState", { session_id: sid, turn: -1 });
  assert.equal(old.turn, 1);
  assert.equal(old.state_json, latest.state_json);

  const closed = await call(env, "CloseSessions", { session_ids: [sid, "no-such-session"] });
  assert.deepEqual(closed.statuses.map((s) => s.code), [grpc.status.OK, grpc.status.NOT_FOUND]);
});

test("the client closes its channel: no rpc takes the place of Client.close()", async () => {
  // grpc-js gives the client a method per rpc under its name and its lowerCamelCase name, so an
  // rpc named Close would replace Client.close(); the proto's is CloseSessions.
  const client = new v1.EnvService(address, credentials, OPTIONS);
  assert.equal(typeof client.Close, "undefined");
  assert.equal(typeof client.CloseSessions, "function");
  assert.ok((await call(client, "ListEnvs", {})).envs.length >= 2);
  grpc.closeClient(client);
  assert.equal(client.getChannel().getConnectivityState(false), grpc.connectivityState.SHUTDOWN);
  const other = new v1.EnvService(address, credentials, OPTIONS);
  other.close();
  assert.equal(other.getChannel().getConnectivityState(false), grpc.connectivityState.SHUTDOWN);
});

test("a replica with tokens refuses a call without one", { skip: !token && "the replica has no tokens" }, async () => {
  const anonymous = new v1.EnvService(address, credentials);
  try {
    await assert.rejects(call(anonymous, "ListEnvs", {}), (err) => err.code === grpc.status.UNAUTHENTICATED);
  } finally {
    anonymous.close();
  }
});
