// Plays a few turns of sokoban on an envserve replica: ENVSERVE_ADDRESS (host:port), and
// ENVSERVE_TOKEN where the replica checks bearer tokens.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"time"

	envservev1 "envserve.dev/gen/go/envserve/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// sokobanState is the part of sokoban's ground truth this program reads; positions are [row, col].
type sokobanState struct {
	Player  []int    `json:"player"`
	Boxes   [][]int  `json:"boxes"`
	Targets [][]int  `json:"targets"`
	Grid    []string `json:"grid"`
}

// mustOK stops at a failed item: batch calls report per-item failures in the result, not as an error.
func mustOK(r *envservev1.StepResult) *envservev1.StepResult {
	if c := codes.Code(r.GetStatus().GetCode()); c != codes.OK {
		log.Fatalf("session %s: %v: %s", r.GetSessionId(), c, r.GetStatus().GetMessage())
	}
	return r
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if token := os.Getenv("ENVSERVE_TOKEN"); token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	conn, err := grpc.Dial(os.Getenv("ENVSERVE_ADDRESS"), grpc.WithInsecure())
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	env := envservev1.NewEnvServiceClient(conn)
	state := envservev1.NewStateServiceClient(conn)

	opened, err := env.Open(ctx, &envservev1.OpenRequest{
		EnvId: "sokoban", Count: 1, ConfigJson: `{"dim_room": 6, "num_boxes": 1}`})
	if err != nil {
		log.Fatal(err) // a bad config is codes.InvalidArgument, an env the replica lacks codes.NotFound
	}
	id := opened.SessionIds[0]

	reset, err := env.Reset(ctx, &envservev1.ResetRequest{Items: []*envservev1.ResetItem{
		{SessionId: id, Seed: proto.Int64(3)}}})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(mustOK(reset.Results[0]).GetObservation().GetText())

	for _, action := range []string{"Up", "Left", "Right"} {
		stepped, err := env.Step(ctx, &envservev1.StepRequest{Items: []*envservev1.StepItem{
			{SessionId: id, Action: "<think>try it</think><answer>" + action + "</answer>"}}})
		if err != nil {
			log.Fatal(err)
		}
		r := mustOK(stepped.Results[0])
		fmt.Printf("%s: valid=%v reward=%.1f done=%v %s\n", action, r.ActionValid, r.Reward, r.Done, r.Feedback)
		if r.Done {
			break
		}
	}

	// No turn: the latest. The ground truth is JSON text, so positions decode as ints.
	truth, err := state.ReadState(ctx, &envservev1.ReadStateRequest{SessionId: id})
	if err != nil {
		log.Fatal(err)
	}
	var s sokobanState
	if err := json.Unmarshal([]byte(truth.StateJson), &s); err != nil {
		log.Fatal(err)
	}
	row, col := s.Player[0], s.Player[1]
	fmt.Printf("turn %d: player at (%d, %d) on %q\n", truth.Turn, row, col, string([]rune(s.Grid[row])[col]))

	closed, err := env.CloseSessions(ctx, &envservev1.CloseRequest{SessionIds: []string{id}})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("closed:", codes.Code(closed.Statuses[0].GetCode()))
}
