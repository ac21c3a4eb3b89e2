// celcost prints the estimated CEL cost of every x-kubernetes-validations rule of a CRD, computed
// by Kubernetes' own code (k8s.io/apiextensions-apiserver at the version scripts/get-apiext.sh
// builds): the same walk, cardinalities, compiler, cost estimator and limits the API server uses when
// it admits a CRD. The server only says when a budget is exceeded; this says by how far each rule
// is from it.
//
// Usage: celcost < crd.json   (one CustomResourceDefinition, apiextensions.k8s.io/v1, as JSON)
// Prints one JSON object: per version, every rule with its schema path, its estimated cost per
// evaluation, how many times it can be evaluated per object, their product (what the server checks
// against the per-rule limit) and the CRD's total (checked against the per-CRD limit).
package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/cel/environment"
)

type ruleCost struct {
	Path        string  `json:"path"`
	Rule        string  `json:"rule"`
	Message     string  `json:"message"`
	MaxCost     uint64  `json:"maxCost"`
	Cardinality *uint64 `json:"cardinality"`
	Cost        uint64  `json:"cost"`
	Error       string  `json:"error,omitempty"`
}

type versionCost struct {
	Name  string     `json:"name"`
	Rules []ruleCost `json:"rules"`
	Total uint64     `json:"total"`
}

type report struct {
	CRD                string        `json:"crd"`
	PerCallLimit       uint64        `json:"perCallLimit"`
	PerRuleLimit       uint64        `json:"perRuleLimit"`
	PerCRDLimit        uint64        `json:"perCrdLimit"`
	Versions           []versionCost `json:"versions"`
	CompatibilityLevel string        `json:"celCompatibilityVersion"`
}

func mul(a, b uint64) uint64 {
	if a != 0 && b > math.MaxUint64/a {
		return math.MaxUint64
	}
	return a * b
}

func walk(s *apiextensions.JSONSchemaProps, ctx *validation.CELSchemaContext, path string, envSet *environment.EnvSet, out *versionCost) error {
	if len(s.XValidations) > 0 {
		info, err := ctx.TypeInfo()
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if info == nil {
			return fmt.Errorf("%s: no type information", path)
		}
		results, err := cel.Compile(info.Schema, info.DeclType, celconfig.PerCallLimit, envSet, cel.NewExpressionsEnvLoader())
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		for i, r := range results {
			// What the server's getExpressionCost does: the schema's cardinality where it is bounded,
			// else the compiler's own estimate.
			card := ctx.MaxCardinality
			cost := mul(r.MaxCost, r.MaxCardinality)
			if card != nil {
				cost = mul(r.MaxCost, *card)
			} else {
				c := r.MaxCardinality
				card = &c
			}
			rc := ruleCost{Path: path, Rule: s.XValidations[i].Rule, Message: s.XValidations[i].Message,
				MaxCost: r.MaxCost, Cardinality: card, Cost: cost}
			if r.Error != nil {
				rc.Error = r.Error.Detail
			}
			out.Rules = append(out.Rules, rc)
			if math.MaxUint64-out.Total < cost {
				out.Total = math.MaxUint64
			} else {
				out.Total += cost
			}
		}
	}
	names := make([]string, 0, len(s.Properties))
	for name := range s.Properties {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		prop := s.Properties[name]
		if err := walk(&prop, ctx.ChildPropertyContext(&prop, name), path+"."+name, envSet, out); err != nil {
			return err
		}
	}
	if s.Items != nil && s.Items.Schema != nil {
		if err := walk(s.Items.Schema, ctx.ChildItemsContext(s.Items.Schema), path+"[]", envSet, out); err != nil {
			return err
		}
	}
	if s.AdditionalProperties != nil && s.AdditionalProperties.Schema != nil {
		extra := s.AdditionalProperties.Schema
		if err := walk(extra, ctx.ChildAdditionalPropertiesContext(extra), path+".*", envSet, out); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	var crd apiextensionsv1.CustomResourceDefinition
	if err := json.NewDecoder(os.Stdin).Decode(&crd); err != nil {
		fmt.Fprintln(os.Stderr, "celcost: reading the CRD:", err)
		os.Exit(2)
	}
	envSet := environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion())
	rep := report{CRD: crd.Name, PerCallLimit: celconfig.PerCallLimit,
		PerRuleLimit: validation.StaticEstimatedCostLimit, PerCRDLimit: validation.StaticEstimatedCRDCostLimit,
		CompatibilityLevel: environment.DefaultCompatibilityVersion().String()}
	for _, v := range crd.Spec.Versions {
		vc := versionCost{Name: v.Name, Rules: []ruleCost{}}
		if v.Schema != nil && v.Schema.OpenAPIV3Schema != nil {
			var internal apiextensions.JSONSchemaProps
			if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, &internal, nil); err != nil {
				fmt.Fprintln(os.Stderr, "celcost: converting the schema:", err)
				os.Exit(2)
			}
			if err := walk(&internal, validation.RootCELContext(&internal), "", envSet, &vc); err != nil {
				fmt.Fprintln(os.Stderr, "celcost:", err)
				os.Exit(1)
			}
		}
		rep.Versions = append(rep.Versions, vc)
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(rep); err != nil {
		os.Exit(2)
	}
}
