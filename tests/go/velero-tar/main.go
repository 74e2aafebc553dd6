// velero-tar reads and writes tarballs the way Velero does, with Go's standard library
// only (compress/gzip and archive/tar are what Velero's backup store and restore read
// tarballs with). The finalize tests run it against the agent's output.
//
//	velero-tar list FILE                 one JSON line per entry: the header as Go reads
//	                                     it and the SHA-256 of the content; then the
//	                                     gzip stream is read to its end (CRC checked)
//	                                     and "members N" says how many gzip members
//	velero-tar header NAME SIZE MTIME    writes to stdout the header bytes Velero's
//	                                     finalize writes for an item (pkg/backup's
//	                                     getFileForArchive), mtime in Unix seconds
package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"
)

type entry struct {
	Name     string `json:"name"`
	Typeflag string `json:"typeflag"`
	Mode     int64  `json:"mode"`
	Size     int64  `json:"size"`
	ModTime  int64  `json:"mtime"`
	Uid      int    `json:"uid"`
	Gid      int    `json:"gid"`
	Uname    string `json:"uname"`
	Gname    string `json:"gname"`
	Format   string `json:"format"`
	Sha256   string `json:"sha256"`
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "velero-tar: "+format+"\n", args...)
	os.Exit(1)
}

func list(path string) {
	f, err := os.Open(path)
	if err != nil {
		fail("%v", err)
	}
	defer f.Close()
	buffered := bufio.NewReader(f)
	zr, err := gzip.NewReader(buffered)
	if err != nil {
		fail("gzip: %v", err)
	}
	// One member at a time, to count them.
	zr.Multistream(false)
	tr := tar.NewReader(zr)
	out := json.NewEncoder(os.Stdout)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			fail("tar: %v", err)
		}
		sum := sha256.New()
		if _, err := io.Copy(sum, tr); err != nil {
			fail("reading %s: %v", h.Name, err)
		}
		if err := out.Encode(entry{
			Name: h.Name, Typeflag: string([]byte{h.Typeflag}), Mode: h.Mode, Size: h.Size,
			ModTime: h.ModTime.Unix(), Uid: h.Uid, Gid: h.Gid, Uname: h.Uname, Gname: h.Gname,
			Format: h.Format.String(), Sha256: hex.EncodeToString(sum.Sum(nil)),
		}); err != nil {
			fail("%v", err)
		}
	}
	members := 1
	for {
		// The rest of this member (tar padding after the end blocks), CRC checked.
		if _, err := io.Copy(io.Discard, zr); err != nil {
			fail("gzip: %v", err)
		}
		if err := zr.Reset(buffered); err == io.EOF {
			break
		} else if err != nil {
			fail("gzip: %v", err)
		}
		zr.Multistream(false)
		members++
	}
	fmt.Printf("members %d\n", members)
}

func header(name, size, mtime string) {
	n, err := strconv.ParseInt(size, 10, 64)
	if err != nil {
		fail("size: %v", err)
	}
	t, err := strconv.ParseInt(mtime, 10, 64)
	if err != nil {
		fail("mtime: %v", err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	// Velero's header for a finalized item, field for field.
	hdr := &tar.Header{
		Name:     name,
		Size:     n,
		Typeflag: tar.TypeReg,
		Mode:     0755,
		ModTime:  time.Unix(t, 0),
	}
	if err := tw.WriteHeader(hdr); err != nil {
		fail("%v", err)
	}
	os.Stdout.Write(buf.Bytes())
}

func main() {
	switch {
	case len(os.Args) == 3 && os.Args[1] == "list":
		list(os.Args[2])
	case len(os.Args) == 5 && os.Args[1] == "header":
		header(os.Args[2], os.Args[3], os.Args[4])
	default:
		fail("usage: velero-tar list FILE | velero-tar header NAME SIZE MTIME")
	}
}
