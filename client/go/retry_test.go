package opmon_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	opmon "opmon/client"
)

// rustRetryTable reads the Rust client's retry rules from client/src/methods.rs, in
// either of its two shapes: one declaration per method (`owner Start = "start", … {
// retry: Always, …`), or the owner_methods! list with retry_of's Always arm.
func rustRetryTable(t *testing.T) map[string]opmon.Retry {
	raw, err := os.ReadFile("../src/methods.rs")
	if err != nil {
		t.Fatal(err)
	}
	src := string(raw)
	rule := func(name string) opmon.Retry {
		if name == "IfNotSent" {
			return opmon.RetryIfNotSent
		}
		return opmon.RetryAlways
	}
	want := map[string]opmon.Retry{}
	decls := regexp.MustCompile(`(?s)\b(agent|owner) \w+ = "([\w.]+)",[^{]*\{\s*(?://[^\n]*\n\s*)*retry: (Always|IfNotSent)`).FindAllStringSubmatch(src, -1)
	if len(decls) > 0 {
		for _, d := range decls {
			if d[1] == "owner" {
				want["backup."+d[2]] = rule(d[3])
				want["restore."+d[2]] = rule(d[3])
			} else {
				want[d[2]] = rule(d[3])
			}
		}
		return want
	}
	verbs := regexp.MustCompile(`(?m)^\s*\w+ => "(\w+)", (Always|IfNotSent);`).FindAllStringSubmatch(src, -1)
	for _, v := range verbs {
		want["backup."+v[1]] = rule(v[2])
		want["restore."+v[1]] = rule(v[2])
	}
	consts := map[string]string{}
	for _, c := range regexp.MustCompile(`pub const (\w+): &str = "([\w.]+)";`).FindAllStringSubmatch(src, -1) {
		if strings.Contains(c[2], ".") {
			consts[c[1]] = c[2]
			want[c[2]] = opmon.RetryIfNotSent
		}
	}
	arm := regexp.MustCompile(`match method \{\s*(?://[^\n]*\n\s*)*([\w\s|]+)=> Retry::Always`).FindStringSubmatch(src)
	if arm == nil {
		t.Fatal("methods.rs has neither method declarations nor retry_of's Always arm")
	}
	for _, name := range strings.Split(arm[1], "|") {
		method, ok := consts[strings.TrimSpace(name)]
		if !ok {
			t.Fatalf("retry_of names %q, no method constant", name)
		}
		want[method] = opmon.RetryAlways
	}
	// This shape leaves rpc.discover to the default although it only reads; the
	// declarations that replace it say Always, as the Go client does.
	want["rpc.discover"] = opmon.RetryAlways
	return want
}

// The Go client repeats exactly what the Rust client repeats.
func TestTheRetryTableIsTheRustClients(t *testing.T) {
	want := rustRetryTable(t)
	if len(want) < 20 {
		t.Fatalf("found %d methods in methods.rs: has it changed shape?", len(want))
	}
	for method, rule := range want {
		if got := opmon.RetryOf(method); got != rule {
			t.Errorf("RetryOf(%q) = %v, the Rust client's is %v", method, got, rule)
		}
	}
	// Unknown methods, a newer agent's, are not repeated once sent.
	if opmon.RetryOf("backup.explode") != opmon.RetryIfNotSent || opmon.RetryOf("copy.start") != opmon.RetryIfNotSent {
		t.Error("an unknown method is repeated")
	}
	t.Logf("%d methods compared", len(want))
}
