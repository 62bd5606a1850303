// Package templates holds the libvirt domain XML templates kvbox defines
// boxes from. They are embedded in the kvbox binary; an operator can point
// kvbox at a file of their own instead.
package templates

import _ "embed"

// Box is the default template for a box. It is a text/template over
// domain.TemplateData.
//
//go:embed box.xml
var Box string
