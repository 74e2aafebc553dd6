package opmon_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	opmon "opmon/client"
)

// The Go client repeats exactly what the Rust client repeats: its table is read from
// client/src/methods.rs (the owner_methods! list and retry_of's Always arm).
func TestTheRetryTableIsTheRustClients(t *testing.T) {
	raw, err := os.ReadFile("../src/methods.rs")
	if err != nil {
		t.Fatal(err)
	}
	src := string(raw)
	want := map[string]opmon.Retry{}
	verbs := regexp.MustCompile(`(?m)^\s*\w+ => "(\w+)", (Always|IfNotSent);`).FindAllStringSubmatch(src, -1)
	if len(verbs) < 10 {
		t.Fatalf("found %d owner methods in methods.rs: has its owner_methods! list changed shape?", len(verbs))
	}
	for _, v := range verbs {
		rule := opmon.RetryAlways
		if v[2] == "IfNotSent" {
			rule = opmon.RetryIfNotSent
		}
		want["backup."+v[1]] = rule
		want["restore."+v[1]] = rule
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
		t.Fatal("retry_of's Always arm not found in methods.rs")
	}
	for _, name := range strings.Split(arm[1], "|") {
		method, ok := consts[strings.TrimSpace(name)]
		if !ok {
			t.Fatalf("retry_of names %q, no method constant", name)
		}
		want[method] = opmon.RetryAlways
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
