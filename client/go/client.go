package opmon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode"
)

// Defaults of the Options.
const (
	defaultConnectTimeout  = 5 * time.Second
	defaultCallTimeout     = 2 * time.Minute
	defaultFinalizeTimeout = time.Hour
	defaultMaxConnections  = 32
	// Largest answer read (a list of 1,000 owners, the operations of a big backup).
	maxResponse = 256 << 20
	// An idle connection older than this is closed rather than reused, so a request
	// does not race the agent closing it.
	maxIdle = 30 * time.Second
	// Longest single wait the client asks the agent for (it allows 10 minutes).
	waitSlice = time.Minute
)

// Client calls the opmon agent's JSON-RPC API over HTTP/1.1 on its Unix socket. It is
// safe for concurrent use and outlives agent restarts:
//
//   - a call whose connection cannot be made (the agent is restarting) is tried again
//     with backoff until its timeout;
//   - a call that was sent and whose answer was lost is sent again only if its method
//     is safe to repeat (RetryOf); otherwise it fails with an error matching
//     ErrOutcomeUnknown;
//   - every call is bounded by its context and by the call timeout (finalize by the
//     finalize timeout; wait by its own timeout plus the call timeout).
type Client struct {
	socket          string
	transport       *http.Transport
	http            *http.Client
	connectTimeout  time.Duration
	callTimeout     time.Duration
	finalizeTimeout time.Duration
	nextID          uint64
}

// Option sets a Client's setting.
type Option func(*Client)

// WithConnectTimeout bounds Connect's first round trip (default 5s).
func WithConnectTimeout(d time.Duration) Option { return func(c *Client) { c.connectTimeout = d } }

// WithCallTimeout bounds each call, reconnects and repeats included (default 2m).
func WithCallTimeout(d time.Duration) Option { return func(c *Client) { c.callTimeout = d } }

// WithFinalizeTimeout bounds finalize, which may rewrite a large tarball (default 1h).
func WithFinalizeTimeout(d time.Duration) Option {
	return func(c *Client) { c.finalizeTimeout = d }
}

// WithMaxConnections bounds the connections open at once (default 32); more calls in
// parallel wait for one (within their timeout).
func WithMaxConnections(n int) Option {
	return func(c *Client) {
		if n < 1 {
			n = 1
		}
		c.transport.MaxConnsPerHost = n
		c.transport.MaxIdleConnsPerHost = n
	}
}

// New makes a client of the agent on the Unix socket path without connecting; the
// first call connects. DefaultSocketPath() is the usual path.
func New(socket string, opts ...Option) *Client {
	c := &Client{
		socket:          socket,
		connectTimeout:  defaultConnectTimeout,
		callTimeout:     defaultCallTimeout,
		finalizeTimeout: defaultFinalizeTimeout,
	}
	dialer := net.Dialer{}
	c.transport = &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, "unix", socket)
		},
		MaxConnsPerHost:     defaultMaxConnections,
		MaxIdleConnsPerHost: defaultMaxConnections,
		IdleConnTimeout:     maxIdle,
		DisableCompression:  true,
	}
	c.http = &http.Client{Transport: c.transport}
	for _, opt := range opts {
		opt(c)
	}
	return c
}

// Connect makes a client and one round trip (agent.status) within the connect
// timeout: it fails at once if nothing listens on socket, and with an error wrapping
// context.DeadlineExceeded if nothing answers in time (a stopped or hung agent).
func Connect(ctx context.Context, socket string, opts ...Option) (*Client, error) {
	c := New(socket, opts...)
	ctx, cancel := context.WithTimeout(ctx, c.connectTimeout)
	defer cancel()
	pause := 20 * time.Millisecond
	for {
		var status AgentStatus
		err := c.exchangeOnce(ctx, "agent.status", struct{}{}, &status)
		var rpc *RPCError
		switch {
		case err == nil:
			return c, nil
		case errors.As(err, &rpc) && rpc.HTTPStatus == http.StatusOK:
			// Any JSON-RPC answer proves the peer serves.
			return c, nil
		case errors.As(err, &rpc) && (rpc.HTTPStatus == http.StatusTooManyRequests || rpc.HTTPStatus == http.StatusServiceUnavailable):
			// Over a connection limit, refused before reading: one may come free.
		default:
			c.Close()
			return nil, err
		}
		select {
		case <-ctx.Done():
			c.Close()
			return nil, err
		case <-time.After(pause):
		}
		if pause *= 2; pause > time.Second {
			pause = time.Second
		}
	}
}

// Socket is the agent's socket path.
func (c *Client) Socket() string { return c.socket }

// Close closes the idle connections; calls in flight go on.
func (c *Client) Close() { c.transport.CloseIdleConnections() }

// Call calls any method with params sent by name (a struct or map; nil for none) and
// decodes its result into result (nil to ignore it), repeated after a lost connection
// as RetryOf says.
func (c *Client) Call(ctx context.Context, method string, params, result any) error {
	if params == nil {
		params = struct{}{}
	}
	return c.call(ctx, method, func() any { return params }, result, c.callTimeout)
}

// request is a JSON-RPC 2.0 request with params by name.
type request struct {
	JSONRPC string `json:"jsonrpc"`
	ID      uint64 `json:"id"`
	Method  string `json:"method"`
	Params  any    `json:"params"`
}

// rpcErrorObject is the error member of an answer.
type rpcErrorObject struct {
	Code    int             `json:"code"`
	Message string          `json:"message"`
	Data    json.RawMessage `json:"data"`
}

// attempt is the outcome of one exchange.
type attempt struct {
	status int
	body   []byte
	// Whether the request may have reached the agent.
	sent bool
	err  error
}

// post sends body once and reads the whole answer.
func (c *Client) post(ctx context.Context, body []byte) attempt {
	var mu sync.Mutex
	sent := false
	trace := &httptrace.ClientTrace{
		// Each attempt of the transport starts with GetConn: what counts is the last.
		GetConn: func(string) { mu.Lock(); sent = false; mu.Unlock() },
		// Called once the request was written, or writing it failed part way: either
		// way the agent may have it.
		WroteRequest: func(httptrace.WroteRequestInfo) { mu.Lock(); sent = true; mu.Unlock() },
	}
	wasSent := func() bool { mu.Lock(); defer mu.Unlock(); return sent }
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, "http://localhost/", bytes.NewReader(body))
	if err != nil {
		return attempt{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		var u *url.Error // "Post \"http://localhost/\": " says nothing here
		if errors.As(err, &u) {
			err = u.Err
		}
		return attempt{sent: wasSent(), err: err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponse+1))
	if err != nil {
		return attempt{sent: true, err: err}
	}
	if len(data) > maxResponse {
		return attempt{sent: true, status: -1}
	}
	return attempt{status: resp.StatusCode, body: data, sent: true}
}

// exchangeOnce makes one attempt and decodes it, without retrying.
func (c *Client) exchangeOnce(ctx context.Context, method string, params, result any) error {
	body, err := c.requestBody(method, params)
	if err != nil {
		return err
	}
	a := c.post(ctx, body)
	if a.err != nil {
		return &TransportError{Method: method, Socket: c.socket, Sent: a.sent, Err: a.err}
	}
	return c.decode(method, a, result)
}

func (c *Client) requestBody(method string, params any) ([]byte, error) {
	id := atomic.AddUint64(&c.nextID, 1)
	body, err := json.Marshal(request{JSONRPC: "2.0", ID: id, Method: method, Params: params})
	if err != nil {
		return nil, fmt.Errorf("%s: encoding the params: %w", method, err)
	}
	return body, nil
}

// call sends the request until it is answered, following the method's retry rule,
// within ctx and timeout. params is asked again for each attempt (wait sends the time
// that is left).
func (c *Client) call(ctx context.Context, method string, params func() any, result any, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	retry := RetryOf(method)
	pause := 20 * time.Millisecond
	var last error
	for {
		body, err := c.requestBody(method, params())
		if err != nil {
			return err
		}
		a := c.post(ctx, body)
		switch {
		case a.err == nil && (a.status == http.StatusTooManyRequests || a.status == http.StatusServiceUnavailable):
			// Too many connections: refused before the request was read.
			last = c.decode(method, a, nil)
			a.sent = false
		case a.err == nil:
			return c.decode(method, a, result)
		case a.sent && retry == RetryIfNotSent:
			return &InterruptedError{Method: method, Err: causeOf(ctx, a.err)}
		case ctx.Err() != nil:
			return &TransportError{Method: method, Socket: c.socket, Sent: a.sent, Err: ctx.Err(), Last: last}
		case !a.sent && !transientDialError(a.err):
			return &TransportError{Method: method, Socket: c.socket, Err: a.err}
		default:
			last = a.err
		}
		timer := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			timer.Stop()
			return &TransportError{Method: method, Socket: c.socket, Sent: a.sent, Err: ctx.Err(), Last: last}
		case <-timer.C:
		}
		if pause *= 2; pause > time.Second {
			pause = time.Second
		}
	}
}

// causeOf is the context's error when it ended (the I/O error is only its symptom).
func causeOf(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// transientDialError: a connect error that may clear up by itself (the agent is
// restarting: its socket is missing or refuses; or its backlog is full).
func transientDialError(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.EAGAIN) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// decode reads an answer into result, or the error it carries.
func (c *Client) decode(method string, a attempt, result any) error {
	if a.status == -1 {
		return &ProtocolError{Method: method, What: fmt.Sprintf("an answer over the limit of %d bytes", maxResponse)}
	}
	var envelope map[string]json.RawMessage
	if err := json.Unmarshal(a.body, &envelope); err != nil || envelope == nil {
		if a.status != http.StatusOK {
			return &ProtocolError{Method: method, What: fmt.Sprintf("HTTP %d: %s", a.status, shown(a.body))}
		}
		return &ProtocolError{Method: method, What: "something that is not JSON-RPC: " + shown(a.body), Err: err}
	}
	if raw, ok := envelope["error"]; ok && string(raw) != "null" {
		var e rpcErrorObject
		if err := json.Unmarshal(raw, &e); err != nil {
			return &ProtocolError{Method: method, What: "an error that is not JSON-RPC's", Err: err}
		}
		return &RPCError{Method: method, Code: e.Code, Message: e.Message, Data: e.Data, HTTPStatus: a.status}
	}
	raw, ok := envelope["result"]
	if a.status != http.StatusOK {
		return &ProtocolError{Method: method, What: fmt.Sprintf("HTTP %d: %s", a.status, shown(a.body))}
	}
	if !ok {
		return &ProtocolError{Method: method, What: "neither a result nor an error"}
	}
	if result == nil {
		return nil
	}
	if err := json.Unmarshal(raw, result); err != nil {
		return &ProtocolError{Method: method, What: "a result that is not its type", Err: err}
	}
	return nil
}

// shown is an answer's text for an error message: trimmed, control characters
// escaped, at most 512 bytes.
func shown(body []byte) string {
	text := strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return '?'
		}
		return r
	}, strings.TrimSpace(string(body)))
	if len(text) > 512 {
		cut := 512
		for cut > 0 && !isRuneStart(text[cut]) {
			cut--
		}
		text = text[:cut] + "…"
	}
	return text
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }
