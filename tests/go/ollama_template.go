// Renders an Ollama Modelfile TEMPLATE with Go's text/template, the engine Ollama itself uses.
// Usage: go run ollama_template.go TEMPLATE_FILE < values.json   (values: {"System": ..., "Messages": [...]})
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"text/template"
)

func main() {
	text, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var values map[string]any
	if err := json.NewDecoder(os.Stdin).Decode(&values); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	tmpl, err := template.New("modelfile").Parse(string(text))
	if err != nil {
		fmt.Fprintln(os.Stderr, "parse:", err)
		os.Exit(1)
	}
	if err := tmpl.Execute(os.Stdout, values); err != nil {
		fmt.Fprintln(os.Stderr, "execute:", err)
		os.Exit(1)
	}
}
