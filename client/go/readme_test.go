package opmon_test

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Every Go snippet of this README.md and of the repository's is the body of a function
// of example_test.go, which the compiler checks: no README shows Go that does not build.
func TestTheReadmesSnippetsAreCompiledExamples(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	top, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	examples, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	flat := func(s string) string {
		var lines []string
		for _, line := range strings.Split(s, "\n") {
			if line = strings.TrimSpace(line); line != "" {
				lines = append(lines, line)
			}
		}
		return strings.Join(lines, "\n")
	}
	compiled := flat(string(examples))
	snippet := regexp.MustCompile("(?s)```go\n(.*?)```")
	snippets := snippet.FindAllStringSubmatch(string(readme), -1)
	if len(snippets) == 0 {
		t.Fatal("README.md has no Go snippet")
	}
	for _, s := range append(snippets, snippet.FindAllStringSubmatch(string(top), -1)...) {
		if !strings.Contains(compiled, flat(s[1])) {
			t.Errorf("this README snippet is not in example_test.go:\n%s", s[1])
		}
	}
}
