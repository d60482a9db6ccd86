// The Go client, generated from proto/envserve/v1/envserve.proto, against a running replica serving
// sokoban and frozenlake: ENVSERVE_ADDRESS (host:port), ENVSERVE_TOKEN where it checks tokens.
package envserveclient

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	envservev1 "envserve.dev/gen/go/envserve/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

type client struct {
	conn  *grpc.ClientConn
	env   envservev1.EnvServiceClient
	state envservev1.StateServiceClient
	ctx   context.Context
}

// dial connects to the replica; the context carries the bearer token when there is one. The
// deadline only stops a broken replica from hanging the run.
func dial(t *testing.T) *client {
	t.Helper()
	address := os.Getenv("ENVSERVE_ADDRESS")
	if address == "" {
		t.Fatal("ENVSERVE_ADDRESS is not set")
	}
	conn, err := grpc.Dial(address, grpc.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	if token := os.Getenv("ENVSERVE_TOKEN"); token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	c := &client{conn, envservev1.NewEnvServiceClient(conn), envservev1.NewStateServiceClient(conn), ctx}
	t.Cleanup(func() {
		if err := conn.Close(); err != nil {
			t.Errorf("closing the connection: %v", err)
		}
	})
	return c
}

// checkOK fails unless the result carries a status and it is OK. The nil check matters in Go: the
// getters of an absent message return zero values, so GetStatus().GetCode() alone reads 0 (OK).
func checkOK(t *testing.T, r *envservev1.StepResult) *envservev1.StepResult {
	t.Helper()
	if r.Status == nil {
		t.Fatalf("result of %s has no status", r.SessionId)
	}
	if c := codes.Code(r.Status.Code); c != codes.OK {
		t.Fatalf("result of %s: %v %s", r.SessionId, c, r.Status.Message)
	}
	return r
}

func wantCode(t *testing.T, err error, want codes.Code, what string) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("%s: got %v (%v), want %v", what, got, err, want)
	}
	if status.Convert(err).Message() == "" {
		t.Fatalf("%s: %v carries no message", what, want)
	}
}

func (c *client) open(t *testing.T, env, configJSON string) string {
	t.Helper()
	r, err := c.env.Open(c.ctx, &envservev1.OpenRequest{EnvId: env, Count: 1, ConfigJson: configJSON})
	if err != nil {
		t.Fatalf("Open %s %s: %v", env, configJSON, err)
	}
	if len(r.SessionIds) != 1 || r.LeaseSeconds <= 0 {
		t.Fatalf("Open: %v", r)
	}
	return r.SessionIds[0]
}

func (c *client) reset(t *testing.T, id string, seed int64) *envservev1.StepResult {
	t.Helper()
	r, err := c.env.Reset(c.ctx, &envservev1.ResetRequest{Items: []*envservev1.ResetItem{
		{SessionId: id, Seed: proto.Int64(seed)}}})
	if err != nil {
		t.Fatal(err)
	}
	return checkOK(t, r.Results[0])
}

func (c *client) step(t *testing.T, id, action string) *envservev1.StepResult {
	t.Helper()
	r, err := c.env.Step(c.ctx, &envservev1.StepRequest{Items: []*envservev1.StepItem{
		{SessionId: id, Action: action}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Results) != 1 || r.Results[0].SessionId != id {
		t.Fatalf("Step %s: %v", id, r)
	}
	return r.Results[0]
}

func answer(actions ...string) string {
	return "<think>planned from the ground truth</think><answer>" + strings.Join(actions, ", ") + "</answer>"
}

// readState reads the ground truth (turn nil: the latest) and decodes its JSON into into.
func (c *client) readState(t *testing.T, id string, turn *int32, into interface{}) *envservev1.GetStateResponse {
	t.Helper()
	r, err := c.state.ReadState(c.ctx, &envservev1.ReadStateRequest{SessionId: id, Turn: turn})
	if err != nil {
		t.Fatalf("ReadState %s: %v", id, err)
	}
	if err := json.Unmarshal([]byte(r.StateJson), into); err != nil {
		t.Fatalf("state_json of %s: %v in %q", id, err, r.StateJson)
	}
	return r
}

type sokobanState struct {
	Player  []int    `json:"player"`
	Boxes   [][]int  `json:"boxes"`
	Targets [][]int  `json:"targets"`
	Grid    []string `json:"grid"`
	Dim     []int    `json:"dim"`
}

type frozenLakeState struct {
	Player []int    `json:"player"`
	Goal   []int    `json:"goal"`
	Holes  [][]int  `json:"holes"`
	Size   int      `json:"size"`
	Grid   []string `json:"grid"`
	Status string   `json:"status"`
}

// cell is the character at [row, col] of a text grid; grids hold non-ASCII marks, so by rune.
func cell(grid []string, pos []int) rune {
	return []rune(grid[pos[0]])[pos[1]]
}

func TestListEnvsAndSpec(t *testing.T) {
	c := dial(t)
	listed, err := c.env.ListEnvs(c.ctx, &envservev1.ListEnvsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{}
	for _, e := range listed.Envs {
		served[e.EnvId] = true
	}
	if !served["sokoban"] || !served["frozenlake"] || listed.ReplicaId == "" {
		t.Fatalf("ListEnvs: %v", listed)
	}

	spec, err := c.env.GetSpec(c.ctx, &envservev1.GetSpecRequest{EnvId: "sokoban"})
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Properties map[string]struct {
			Type    string      `json:"type"`
			Default interface{} `json:"default"`
		} `json:"properties"`
	}
	if err := json.Unmarshal([]byte(spec.ConfigSchemaJson), &schema); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"dim_room", "num_boxes", "max_turns"} {
		if schema.Properties[key].Type != "integer" {
			t.Errorf("config schema of sokoban: %s is %+v", key, schema.Properties[key])
		}
	}
	if spec.MaxTurns <= 0 || spec.DefaultActionFormat == "" || spec.ActionSpace == "" {
		t.Errorf("GetSpec: %v", spec)
	}

	_, err = c.env.GetSpec(c.ctx, &envservev1.GetSpecRequest{EnvId: "no_such_env"})
	wantCode(t, err, codes.NotFound, "GetSpec of an unknown env")
}

func TestBadInputGetsCleanCodes(t *testing.T) {
	c := dial(t)
	_, err := c.env.Open(c.ctx, &envservev1.OpenRequest{EnvId: "sokoban", Count: 1, ConfigJson: `{"no_such_key": 1}`})
	wantCode(t, err, codes.InvalidArgument, "unknown config key")
	if !strings.Contains(status.Convert(err).Message(), "no_such_key") {
		t.Errorf("the message does not name the key: %v", err)
	}
	_, err = c.env.Open(c.ctx, &envservev1.OpenRequest{EnvId: "sokoban", Count: 1, ConfigJson: `{"dim_room": "six"}`})
	wantCode(t, err, codes.InvalidArgument, "config value of the wrong type")
	_, err = c.env.Open(c.ctx, &envservev1.OpenRequest{EnvId: "sokoban", Count: 1, ConfigJson: `dim_room=6`})
	wantCode(t, err, codes.InvalidArgument, "config_json that is not JSON")
	_, err = c.env.Open(c.ctx, &envservev1.OpenRequest{EnvId: "no_such_env", Count: 1})
	wantCode(t, err, codes.NotFound, "unknown env")

	// An unknown session fails its own item, not the call.
	r, err := c.env.Step(c.ctx, &envservev1.StepRequest{Items: []*envservev1.StepItem{
		{SessionId: "no-such-session", Action: answer("Up")}}})
	if err != nil {
		t.Fatal(err)
	}
	if s := r.Results[0].Status; s == nil || codes.Code(s.Code) != codes.NotFound || s.Message == "" {
		t.Fatalf("Step of an unknown session: %v", r.Results[0])
	}
	_, err = c.state.ReadState(c.ctx, &envservev1.ReadStateRequest{SessionId: "no-such-session"})
	wantCode(t, err, codes.NotFound, "ReadState of an unknown session")

	if os.Getenv("ENVSERVE_TOKEN") != "" {
		_, err := c.env.ListEnvs(context.Background(), &envservev1.ListEnvsRequest{})
		wantCode(t, err, codes.Unauthenticated, "a call without the token")
	}
}

func TestSokobanSessionStepsReadsForksAndCloses(t *testing.T) {
	c := dial(t)
	id := c.open(t, "sokoban", `{"dim_room": 6, "num_boxes": 1, "max_turns": 20}`)

	first := c.reset(t, id, 7)
	if first.Turn != 0 || first.Observation.GetText() == "" {
		t.Fatalf("Reset: %v", first)
	}
	var info struct {
		Seed *int64 `json:"seed"`
	}
	if err := json.Unmarshal([]byte(first.InfoJson), &info); err != nil || info.Seed == nil || *info.Seed != 7 {
		t.Fatalf("info_json %q: seed %v, %v", first.InfoJson, info.Seed, err)
	}

	var start sokobanState
	truth := c.readState(t, id, nil, &start)
	if truth.Turn != 0 || truth.Anchor != first.Anchor || truth.EnvId != "sokoban" {
		t.Fatalf("ReadState after reset: turn %d anchor %q, reset's anchor %q", truth.Turn, truth.Anchor, first.Anchor)
	}
	if len(start.Player) != 2 || len(start.Boxes) != 1 || len(start.Grid) != 6 {
		t.Fatalf("sokoban state: %+v", start)
	}
	// Positions are ints: they index the grid, and the observation's text has the player there.
	if p := cell(start.Grid, start.Player); p != 'P' && p != 'S' {
		t.Fatalf("grid at the player %v is %q:\n%s", start.Player, p, strings.Join(start.Grid, "\n"))
	}
	if p := cell(strings.Split(first.Observation.Text, "\n"), start.Player); p != 'P' && p != 'S' {
		t.Fatalf("observation at the player %v is %q:\n%s", start.Player, p, first.Observation.Text)
	}

	t.Logf("sokoban seed 7, player at %v:\n%s", start.Player, strings.Join(start.Grid, "\n"))
	var last *envservev1.StepResult
	for i, action := range []string{"Up", "Left", "Down"} {
		last = checkOK(t, c.step(t, id, answer(action)))
		t.Logf("%s: reward %.1f done %v", action, last.Reward, last.Done)
		if !last.ActionValid || last.Turn != int32(i+1) || len(last.ParsedActions) != 1 {
			t.Fatalf("Step %s: %v", action, last)
		}
		if last.Done {
			break
		}
	}
	var now sokobanState
	latest := c.readState(t, id, nil, &now)
	if latest.Turn != last.Turn || latest.Anchor != last.Anchor {
		t.Fatalf("ReadState without a turn: turn %d anchor %q; latest step: turn %d anchor %q",
			latest.Turn, latest.Anchor, last.Turn, last.Anchor)
	}
	if p := cell(now.Grid, now.Player); p != 'P' && p != 'S' {
		t.Fatalf("grid at the player %v is %q", now.Player, p)
	}
	var again sokobanState
	if zero := c.readState(t, id, proto.Int32(0), &again); zero.Turn != 0 || zero.Anchor != first.Anchor {
		t.Fatalf("ReadState turn 0: %v", zero)
	}

	// A malformed action is the agent's mistake, reported in the result, not a failed call.
	bad := checkOK(t, c.step(t, id, "walk north please"))
	if bad.ActionValid || bad.Feedback == "" {
		t.Fatalf("malformed action: %v", bad)
	}

	forked, err := c.env.Fork(c.ctx, &envservev1.ForkRequest{SessionId: id, Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(forked.SessionIds) != 1 || forked.SessionIds[0] == id {
		t.Fatalf("Fork: %v", forked)
	}
	fork := forked.SessionIds[0]
	var original, copied sokobanState
	before := c.readState(t, id, nil, &original)
	if got := c.readState(t, fork, nil, &copied); got.Anchor != before.Anchor {
		t.Fatalf("the fork starts in %q, the original is in %q", got.Anchor, before.Anchor)
	}
	// Step the fork until it leaves the original's state (a move into a wall changes nothing).
	moved := false
	for _, action := range []string{"Up", "Down", "Left", "Right"} {
		r := checkOK(t, c.step(t, fork, answer(action)))
		if r.Anchor != before.Anchor {
			moved = true
			break
		}
	}
	if !moved {
		t.Fatal("no move changed the fork's state")
	}
	var unmoved sokobanState
	if after := c.readState(t, id, nil, &unmoved); after.Anchor != before.Anchor || after.Turn != before.Turn {
		t.Fatalf("stepping the fork moved the original: %v -> %v", before, after)
	}

	closed, err := c.env.CloseSessions(c.ctx, &envservev1.CloseRequest{SessionIds: []string{id, fork, "no-such-session"}})
	if err != nil {
		t.Fatal(err)
	}
	var got []codes.Code
	for _, s := range closed.Statuses {
		got = append(got, codes.Code(s.GetCode()))
	}
	if len(got) != 3 || got[0] != codes.OK || got[1] != codes.OK || got[2] != codes.NotFound {
		t.Fatalf("CloseSessions: %v", got)
	}
	if s := c.step(t, id, answer("Up")).Status; s == nil || codes.Code(s.Code) != codes.NotFound {
		t.Fatalf("Step of a closed session: %v", s)
	}
}

// route is the shortest path of moves from the player to the goal around the holes.
func route(s frozenLakeState) []string {
	type cellPos struct{ r, c int }
	hole := map[cellPos]bool{}
	for _, h := range s.Holes {
		hole[cellPos{h[0], h[1]}] = true
	}
	moves := []struct {
		name   string
		dr, dc int
	}{{"Up", -1, 0}, {"Down", 1, 0}, {"Left", 0, -1}, {"Right", 0, 1}}
	start, goal := cellPos{s.Player[0], s.Player[1]}, cellPos{s.Goal[0], s.Goal[1]}
	prev := map[cellPos]cellPos{start: start}
	how := map[cellPos]string{}
	queue := []cellPos{start}
	for len(queue) > 0 {
		at := queue[0]
		queue = queue[1:]
		if at == goal {
			var path []string
			for ; at != start; at = prev[at] {
				path = append([]string{how[at]}, path...)
			}
			return path
		}
		for _, m := range moves {
			next := cellPos{at.r + m.dr, at.c + m.dc}
			if next.r < 0 || next.c < 0 || next.r >= s.Size || next.c >= s.Size || hole[next] {
				continue
			}
			if _, seen := prev[next]; !seen {
				prev[next], how[next] = at, m.name
				queue = append(queue, next)
			}
		}
	}
	return nil
}

func TestFrozenLakeEpisodeToSuccess(t *testing.T) {
	c := dial(t)
	id := c.open(t, "frozenlake", `{"size": 4}`)
	c.reset(t, id, 11)
	var lake frozenLakeState
	c.readState(t, id, nil, &lake)
	path := route(lake)
	if len(path) == 0 {
		t.Fatalf("no way to the goal on %v", lake.Grid)
	}
	t.Logf("frozenlake seed 11, route %v:\n%s", path, strings.Join(lake.Grid, "\n"))
	var last *envservev1.StepResult
	total := 0.0
	for len(path) > 0 && (last == nil || !last.Done) {
		n := 3 // the env's default actions per turn
		if len(path) < n {
			n = len(path)
		}
		last = checkOK(t, c.step(t, id, answer(path[:n]...)))
		if !last.ActionValid || int(last.ActionsExecuted) != n {
			t.Fatalf("Step %v: %v", path[:n], last)
		}
		total += last.Reward
		path = path[n:]
	}
	if !last.Done || !last.Success || last.Truncated || total <= 0 {
		t.Fatalf("the episode ended done=%v success=%v truncated=%v return=%.2f", last.Done, last.Success,
			last.Truncated, total)
	}
	var end frozenLakeState
	c.readState(t, id, nil, &end)
	if end.Player[0] != end.Goal[0] || end.Player[1] != end.Goal[1] {
		t.Fatalf("player %v, goal %v", end.Player, end.Goal)
	}
	closed, err := c.env.CloseSessions(c.ctx, &envservev1.CloseRequest{SessionIds: []string{id}})
	if err != nil || len(closed.Statuses) != 1 || codes.Code(closed.Statuses[0].GetCode()) != codes.OK {
		t.Fatalf("CloseSessions: %v %v", closed, err)
	}
}
