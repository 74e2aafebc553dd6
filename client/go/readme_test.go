package opmon_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every Go snippet of this README.md and of the repository's is the body of a function
// of example_test.go or the whole of an example's main.go, which the compiler checks:
// no README shows Go that does not build.
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
	programs, err := filepath.Glob("examples/*/main.go")
	if err != nil {
		t.Fatal(err)
	}
	whole := map[string]bool{}
	for _, program := range programs {
		text, err := os.ReadFile(program)
		if err != nil {
			t.Fatal(err)
		}
		whole[string(text)] = true
	}
	for _, s := range append(snippets, snippet.FindAllStringSubmatch(string(top), -1)...) {
		if !whole[s[1]] && !strings.Contains(compiled, flat(s[1])) {
			t.Errorf("this README snippet is neither in example_test.go nor an examples/*/main.go:\n%s", s[1])
		}
	}
}
