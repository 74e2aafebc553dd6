package opmon_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// The Go client against the OpenRPC document the real agent serves (rpc.discover; the
// same as client/openrpc/opmon.json): every method has a Go function, every param and
// result property a struct field of a compatible type by its JSON name, and no Go field
// or function is left that the document lacks.

// Methods the Go client does not offer, and why.
var notOffered = map[string]string{
	"subscribe":   "WebSocket only; the Go client waits with Owners.Wait",
	"unsubscribe": "WebSocket only",
}

type schema = map[string]any

type document struct {
	Methods []struct {
		Name   string `json:"name"`
		Params []struct {
			Name     string `json:"name"`
			Required bool   `json:"required"`
			Schema   schema `json:"schema"`
		} `json:"params"`
		Result struct {
			Schema schema `json:"schema"`
		} `json:"result"`
		ParamStructure string `json:"paramStructure"`
	} `json:"methods"`
	Components struct {
		Schemas map[string]schema `json:"schemas"`
	} `json:"components"`
}

// loadDocument is the document the real agent serves (rpc.discover), which must be
// the checked-in one.
func loadDocument(t *testing.T) *document {
	t.Helper()
	agent := agenttest.Start(t)
	client, err := opmon.Connect(context.Background(), agent.Socket, opmon.WithConnectTimeout(agenttest.ConnectTimeout))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	var served json.RawMessage
	if err := client.Call(context.Background(), "rpc.discover", nil, &served); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile("../openrpc/opmon.json")
	if err != nil {
		t.Fatal(err)
	}
	var a, b any
	if json.Unmarshal(served, &a) != nil || json.Unmarshal(file, &b) != nil || !reflect.DeepEqual(a, b) {
		t.Errorf("the agent %s serves another document than client/openrpc/opmon.json", agenttest.AgentBinary(t))
	}
	var doc document
	if err := json.Unmarshal(served, &doc); err != nil {
		t.Fatal(err)
	}
	return &doc
}

// goName is the Go function of an API method: Owners.Verb for backup.* and restore.*,
// Client.PartPart for the others ("snapshotter.register": SnapshotterRegister).
func goName(method string) (owner bool, name string) {
	kind, verb, _ := strings.Cut(method, ".")
	if kind == "backup" || kind == "restore" {
		return true, strings.ToUpper(verb[:1]) + verb[1:]
	}
	for _, part := range []string{kind, verb} {
		if part == "rpc" {
			name += "RPC"
		} else {
			name += strings.ToUpper(part[:1]) + part[1:]
		}
	}
	return false, name
}

var (
	contextType = reflect.TypeOf((*context.Context)(nil)).Elem()
	errorType   = reflect.TypeOf((*error)(nil)).Elem()
	timeType    = reflect.TypeOf(time.Time{})
	rawType     = reflect.TypeOf(json.RawMessage{})
	durType     = reflect.TypeOf(opmon.Duration(0))
	marshaler   = reflect.TypeOf((*json.Marshaler)(nil)).Elem()
)

func TestEveryMethodOfTheDocumentHasATypedGoFunction(t *testing.T) {
	doc := loadDocument(t)
	checker := &typeChecker{t: t, schemas: doc.Components.Schemas}
	client := reflect.TypeOf(&opmon.Client{})
	owners := reflect.TypeOf(opmon.Owners{})
	covered := map[string]bool{}
	for _, m := range doc.Methods {
		owner, name := goName(m.Name)
		_, verb, _ := strings.Cut(m.Name, ".")
		if _, skip := notOffered[verb]; skip && owner {
			continue
		}
		receiver := client
		if owner {
			receiver = owners
		}
		fn, ok := receiver.MethodByName(name)
		if !ok {
			t.Errorf("%s: no Go function %s.%s", m.Name, receiver, name)
			continue
		}
		covered[receiver.String()+"."+name] = true
		ft := fn.Type // receiver first
		if ft.NumIn() < 2 || ft.In(1) != contextType || ft.NumIn() > 3 {
			t.Errorf("%s: %s.%s must take (ctx) or (ctx, params)", m.Name, receiver, name)
			continue
		}
		// Params: a struct with a field per param, or a string for the single `name`.
		if m.ParamStructure != "by-name" {
			t.Errorf("%s: params %s", m.Name, m.ParamStructure)
		}
		if ft.NumIn() == 2 && len(m.Params) > 0 {
			t.Errorf("%s: %s.%s takes no params, the document lists %d", m.Name, receiver, name, len(m.Params))
		}
		if ft.NumIn() == 3 {
			params := ft.In(2)
			if params.Kind() == reflect.String {
				if len(m.Params) != 1 || m.Params[0].Name != "name" {
					t.Errorf("%s: %s.%s takes a name, the document other params", m.Name, receiver, name)
				}
			} else {
				props := schema{}
				var required []any
				for _, p := range m.Params {
					props[p.Name] = p.Schema
					if p.Required {
						required = append(required, p.Name)
					}
				}
				checker.check(m.Name+" params", schema{"type": "object", "properties": props, "required": required}, params)
			}
		}
		// Result: (R, error), or error alone for a null result.
		last := ft.Out(ft.NumOut() - 1)
		if last != errorType {
			t.Errorf("%s: %s.%s must return an error last", m.Name, receiver, name)
			continue
		}
		if ft.NumOut() == 1 {
			if m.Result.Schema["type"] != "null" {
				t.Errorf("%s: %s.%s returns no result", m.Name, receiver, name)
			}
			continue
		}
		checker.check(m.Name+" result", m.Result.Schema, ft.Out(0))
	}
	// Every Go function that makes a call is in the document.
	helpers := map[string]bool{"Socket": true, "Close": true, "Call": true, "Backups": true, "Restores": true, "Kind": true}
	for _, r := range []reflect.Type{client, owners} {
		for i := 0; i < r.NumMethod(); i++ {
			name := r.Method(i).Name
			if !helpers[name] && !covered[r.String()+"."+name] {
				t.Errorf("%s.%s is no method of the document", r, name)
			}
		}
	}
}

type typeChecker struct {
	t       *testing.T
	schemas map[string]schema
}

// resolve follows $ref and single-entry allOf.
func (c *typeChecker) resolve(s schema) schema {
	for {
		if ref, ok := s["$ref"].(string); ok {
			s = c.schemas[strings.TrimPrefix(ref, "#/components/schemas/")]
			continue
		}
		if all, ok := s["allOf"].([]any); ok && len(all) == 1 {
			s = all[0].(schema)
			continue
		}
		return s
	}
}

// types is the schema's JSON types, without null, and whether null is allowed.
func types(s schema) (list []string, nullable bool) {
	switch v := s["type"].(type) {
	case string:
		list = []string{v}
	case []any:
		for _, x := range v {
			list = append(list, x.(string))
		}
	}
	out := list[:0]
	for _, x := range list {
		if x == "null" {
			nullable = true
		} else {
			out = append(out, x)
		}
	}
	return out, nullable
}

func (c *typeChecker) check(path string, s schema, t reflect.Type) {
	s = c.resolve(s)
	// Alternatives: null makes it nullable; strings (enums) and objects are checked.
	for _, key := range []string{"anyOf", "oneOf"} {
		alts, ok := s[key].([]any)
		if !ok {
			continue
		}
		var rest []schema
		nullable := false
		for _, a := range alts {
			a := c.resolve(a.(schema))
			if a["type"] == "null" {
				nullable = true
			} else {
				rest = append(rest, a)
			}
		}
		if nullable && !isNilable(t) {
			c.t.Errorf("%s: nullable, but %s cannot be nil", path, t)
		}
		t = deref(t)
		if len(rest) == 1 {
			c.check(path, rest[0], t)
			return
		}
		c.checkAlternatives(path, rest, t)
		return
	}
	list, nullable := types(s)
	if nullable && !isNilable(t) {
		c.t.Errorf("%s: nullable, but %s cannot be nil", path, t)
	}
	if len(list) == 0 { // any JSON value
		if t != rawType && t.Kind() != reflect.Interface {
			c.t.Errorf("%s: any JSON, but %s", path, t)
		}
		return
	}
	t = deref(t)
	switch list[0] {
	case "string":
		switch {
		case s["format"] == "date-time":
			if t != timeType {
				c.t.Errorf("%s: a time, but %s", path, t)
			}
		case s["pattern"] != nil && strings.Contains(s["pattern"].(string), "ns|us"):
			if t != durType {
				c.t.Errorf("%s: a Go duration, but %s", path, t)
			}
		case t.Kind() != reflect.String:
			c.t.Errorf("%s: a string, but %s", path, t)
		}
	case "integer":
		want := map[any]reflect.Kind{"uint32": reflect.Uint32, "uint64": reflect.Uint64, "int64": reflect.Int64, "int32": reflect.Int32}[s["format"]]
		if t.Kind() != want {
			c.t.Errorf("%s: integer %v, but %s", path, s["format"], t)
		}
	case "number":
		if t.Kind() != reflect.Float64 {
			c.t.Errorf("%s: a number, but %s", path, t)
		}
	case "boolean":
		if t.Kind() != reflect.Bool {
			c.t.Errorf("%s: a boolean, but %s", path, t)
		}
	case "array":
		if t.Kind() != reflect.Slice {
			c.t.Errorf("%s: an array, but %s", path, t)
			return
		}
		c.check(path+"[]", s["items"].(schema), t.Elem())
	case "object":
		c.checkObject(path, s, t)
	default:
		c.t.Errorf("%s: unknown type %v", path, list)
	}
}

// checkAlternatives: several non-null shapes. Enumerations are strings; a string or an
// object is a struct that marshals itself; several objects are one struct with the
// fields of all.
func (c *typeChecker) checkAlternatives(path string, alts []schema, t reflect.Type) {
	var objects []schema
	strs := 0
	for _, a := range alts {
		list, _ := types(a)
		switch {
		case len(list) == 1 && list[0] == "object":
			objects = append(objects, a)
		case len(list) == 1 && (list[0] == "string" || list[0] == "integer"):
			strs++
		default:
			c.t.Errorf("%s: an alternative of no known shape: %v", path, a)
		}
	}
	if len(objects) == 0 {
		if t.Kind() != reflect.String {
			c.t.Errorf("%s: an enumeration, but %s", path, t)
		}
		return
	}
	if strs > 0 && !t.Implements(marshaler) {
		c.t.Errorf("%s: a string or an object, but %s does not marshal itself", path, t)
	}
	union := schema{"type": "object", "properties": schema{}}
	for _, o := range objects {
		for k, v := range o["properties"].(schema) {
			union["properties"].(schema)[k] = v
		}
	}
	// Required only if every alternative requires it.
	if len(objects) == 1 {
		union["required"] = objects[0]["required"]
	}
	c.checkObject(path, union, t)
}

func (c *typeChecker) checkObject(path string, s schema, t reflect.Type) {
	if extra, ok := s["additionalProperties"].(schema); ok && s["properties"] == nil {
		if t.Kind() != reflect.Map || t.Key().Kind() != reflect.String {
			c.t.Errorf("%s: a map, but %s", path, t)
			return
		}
		c.check(path+"{}", extra, t.Elem())
		return
	}
	if t.Kind() == reflect.Map {
		return // a free-form object (rpc.discover's document)
	}
	if t.Kind() != reflect.Struct {
		c.t.Errorf("%s: an object, but %s", path, t)
		return
	}
	fields := map[string]reflect.StructField{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			c.t.Errorf("%s: %s.%s has no JSON name", path, t, f.Name)
			continue
		}
		fields[name] = f
	}
	props, _ := s["properties"].(schema)
	required := map[string]bool{}
	if list, ok := s["required"].([]any); ok {
		for _, r := range list {
			required[r.(string)] = true
		}
	}
	var names []string
	for name := range props {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		f, ok := fields[name]
		if !ok {
			c.t.Errorf("%s: property %q has no field in %s", path, name, t)
			continue
		}
		omit := strings.Contains(f.Tag.Get("json"), ",omitempty")
		if required[name] && omit && strings.HasSuffix(path, "params") {
			c.t.Errorf("%s: %q is required but %s.%s is omitempty", path, name, t, f.Name)
		}
		c.check(fmt.Sprintf("%s.%s", path, name), props[name].(schema), f.Type)
		delete(fields, name)
	}
	for name, f := range fields {
		c.t.Errorf("%s: %s.%s (%q) is not in the document", path, t, f.Name, name)
	}
}

func isNilable(t reflect.Type) bool {
	switch t.Kind() {
	case reflect.Pointer, reflect.Slice, reflect.Map, reflect.Interface:
		return true
	}
	return false
}

func deref(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}
