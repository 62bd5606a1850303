package kvboxnode

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// maxStatusMessage bounds a message kvbox-node puts in a pod's status or
// an event.
const maxStatusMessage = 1024

// publicMessage is err's text for a pod's status and events, which the
// pod's creator reads: a registry's answer is said by its status code and
// reason alone, never its body (the reference may name a service of the
// node's, whose answer is not the pod creator's to read); cut to
// maxStatusMessage.
func publicMessage(err error) string {
	msg := err.Error()
	var te *transport.Error
	if errors.As(err, &te) {
		short := fmt.Sprintf("the registry answered %d %s", te.StatusCode, http.StatusText(te.StatusCode))
		if full := te.Error(); strings.Contains(msg, full) {
			msg = strings.Replace(msg, full, short, 1)
		} else {
			msg = short
		}
	}
	if len(msg) > maxStatusMessage {
		msg = strings.ToValidUTF8(msg[:maxStatusMessage], "") + "..."
	}
	return msg
}
