// Command itemoperations reads an `-itemoperations.json.gz` file the way Velero does and
// writes it back the way Velero does, so a test can compare the bytes with the file.
//
// The types below are transcribed from Velero's own (pkg/itemoperation: BackupOperation,
// RestoreOperation, OperationStatus; pkg/plugin/velero: ResourceIdentifier embedding
// apimachinery's schema.GroupResource; apimachinery's metav1.Time for the times), with
// the same JSON tags. Decoding refuses unknown fields, so a key Velero's types lack fails
// here. Encoding is Velero's: encoding/json's Encoder with its defaults (HTML-safe
// escaping, a newline after the value), as pkg/util/encode.ToJSONGzip and the restore
// controller's putOperationsForRestore write the file, without the gzip layer.
//
// Usage: go run main.go backup|restore FILE.json.gz > reencoded.json
//
// Only the standard library is used: the test needs nothing but a Go toolchain.
package main

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

// Time behaves as metav1.Time does in JSON: RFC 3339 in UTC at second precision, and
// `null` for Go's zero time.
type Time struct {
	time.Time
}

func (t Time) MarshalJSON() ([]byte, error) {
	if t.IsZero() {
		return []byte("null"), nil
	}
	return []byte(`"` + t.UTC().Format(time.RFC3339) + `"`), nil
}

func (t *Time) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		t.Time = time.Time{}
		return nil
	}
	var text string
	if err := json.Unmarshal(b, &text); err != nil {
		return err
	}
	parsed, err := time.Parse(time.RFC3339, text)
	if err != nil {
		return err
	}
	t.Time = parsed.Local()
	return nil
}

// GroupResource is schema.GroupResource: no JSON tags.
type GroupResource struct {
	Group    string
	Resource string
}

// ResourceIdentifier is velero.ResourceIdentifier: no JSON tags, GroupResource embedded.
type ResourceIdentifier struct {
	GroupResource
	Namespace string
	Name      string
}

type OperationStatus struct {
	Phase          string `json:"phase,omitempty"`
	Error          string `json:"error,omitempty"`
	NCompleted     int64  `json:"nCompleted,omitempty"`
	NTotal         int64  `json:"nTotal,omitempty"`
	OperationUnits string `json:"operationUnits,omitempty"`
	Description    string `json:"description,omitempty"`
	Created        *Time  `json:"created,omitempty"`
	Started        *Time  `json:"started,omitempty"`
	Updated        *Time  `json:"updated,omitempty"`
}

type BackupOperationSpec struct {
	BackupName         string               `json:"backupName"`
	BackupUID          string               `json:"backupUID"`
	BackupItemAction   string               `json:"backupItemAction"`
	ResourceIdentifier ResourceIdentifier   `json:"resourceIdentifier"`
	OperationID        string               `json:"operationID"`
	PostOperationItems []ResourceIdentifier `json:"postOperationItems"`
}

type BackupOperation struct {
	Spec   BackupOperationSpec `json:"spec"`
	Status OperationStatus     `json:"status"`
}

type RestoreOperationSpec struct {
	RestoreName        string             `json:"restoreName"`
	RestoreUID         string             `json:"restoreUID"`
	RestoreItemAction  string             `json:"restoreItemAction"`
	ResourceIdentifier ResourceIdentifier `json:"resourceIdentifier"`
	OperationID        string             `json:"operationID"`
}

type RestoreOperation struct {
	Spec   RestoreOperationSpec `json:"spec"`
	Status OperationStatus      `json:"status"`
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "itemoperations: "+format+"\n", args...)
	os.Exit(1)
}

// roundTrip decodes the whole stream into list (a pointer to a slice) strictly and
// writes it to stdout as Velero's encoder does.
func roundTrip(in io.Reader, list any) {
	dec := json.NewDecoder(in)
	dec.DisallowUnknownFields()
	if err := dec.Decode(list); err != nil {
		fail("decoding: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		fail("data after the JSON array (err %v)", err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(list); err != nil {
		fail("encoding: %v", err)
	}
}

func main() {
	if len(os.Args) != 3 {
		fail("usage: itemoperations backup|restore FILE.json.gz")
	}
	file, err := os.Open(os.Args[2])
	if err != nil {
		fail("%v", err)
	}
	defer file.Close()
	gz, err := gzip.NewReader(file)
	if err != nil {
		fail("%s: %v", os.Args[2], err)
	}
	switch os.Args[1] {
	case "backup":
		var list []*BackupOperation
		roundTrip(gz, &list)
	case "restore":
		var list []*RestoreOperation
		roundTrip(gz, &list)
	default:
		fail("unknown kind %q (backup or restore)", os.Args[1])
	}
}
